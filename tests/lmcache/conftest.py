"""Fixtures of the LMCache L2 adapter tests: a real adpkv gateway process and adapters on it.

Run with the lmcache venv: ``$(bash tools/venv.sh lmcache)/bin/python -m pytest tests/lmcache``.
Without lmcache installed every test here is skipped.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

try:  # the rest of the repo's tests run in venvs without lmcache
    import lmcache  # noqa: F401
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.dirname(__file__))
    import pytest

    from adpkv_gateway.ops.spawn import GatewayProcess

    @pytest.fixture(scope="session")
    def lmc_gateway(tmp_path_factory):
        """One gateway (fs card, 64 MiB ring) shared by the adapter tests; one engine at a time."""
        card = tmp_path_factory.mktemp("lmc-card")
        gw = GatewayProcess(str(card), shared_memory_size=64 << 20, engine_timeout_s=3,
                            log_path=str(tmp_path_factory.getbasetemp() / "lmc-gateway.log"))
        gw.start()
        yield gw
        gw.stop()

    @pytest.fixture
    def make_adapter(lmc_gateway):
        """Build AdpL2Adapters on the shared gateway; closes them after the test."""
        from adpkv_lmcache import AdpL2Adapter

        made = []

        def make(**params):
            params.setdefault("port", lmc_gateway.port)
            params.setdefault("timeout_s", 5.0)
            a = AdpL2Adapter(dict(params))
            made.append(a)
            return a

        yield make
        for a in made:
            a.close()

    @pytest.fixture
    def adapter(make_adapter):
        return make_adapter()
