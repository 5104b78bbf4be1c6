"""Fixtures of the SGLang HiCache backend tests: real SGLang host pools on CPU, real gateways.

Run with the sglang venv: ``$(bash tools/venv.sh sglang)/bin/python -m pytest tests/sglang``.
Without sglang installed every test here is skipped.
"""

from __future__ import annotations

import logging
import os
import sys

try:  # the other suites run in venvs without sglang
    import sglang  # noqa: F401
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.dirname(__file__))
    import pytest

    logging.getLogger("adpkv").setLevel(logging.INFO)

    def pytest_configure(config):
        # importing SGLang's pools pulls in flashinfer/cutlass/quantization modules that warn on CPU
        for line in ("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning"):
            config.addinivalue_line("filterwarnings", line)

    @pytest.fixture(scope="session", autouse=True)
    def _warm_page_hash():
        """SGLang's page hash JIT-compiles on first use (g++, libssl-dev): do it once, up front."""
        from sgl_pools import page_hashes
        page_hashes(1)

    @pytest.fixture
    def backends():
        """Factory ``backends(storage_config, pool=None)``: AdpHiCacheStorage instances, closed at the end."""
        from adpkv_sglang import AdpHiCacheStorage
        made = []

        def make(cfg, pool=None):
            b = AdpHiCacheStorage(cfg, {})
            made.append(b)
            if pool is not None:
                b.register_mem_pool_host(pool)
            return b

        yield make
        for b in made:
            b.close()
