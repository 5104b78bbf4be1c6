"""Fixtures of the LMCache 0.5.7 suite (run with the lmcache057 venv: python -m pytest
tests/lmcache057): the tests/lmcache suite (written for 0.5.6) run against LMCache 0.5.7 by
import (test_reused_056.py), LMCache's own conformance check included, and the tests of what
0.5.7 added (test_lmc_057.py), all on real gateway processes.

A later release's suite is this file with its version and the reuse module of this one.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE_056 = os.path.join(os.path.dirname(HERE), "lmcache")
VERSION = "0.5.7"
if SUITE_056 not in sys.path:
    sys.path.insert(0, SUITE_056)

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

from importlib.metadata import version  # noqa: E402

import lmcache  # noqa: E402,F401  (a missing LMCache is a failure of this suite, never a skip)

from suite_reuse import conftest_of, require_release  # noqa: E402

require_release("lmcache057", "LMCache", version("lmcache"), VERSION, "requirements/lmcache057.txt")
_c056 = conftest_of("lmcache")
lmc_gateway = _c056.lmc_gateway       # the 0.5.6 suite's fixtures, by import
make_adapter = _c056.make_adapter
adapter = _c056.adapter
