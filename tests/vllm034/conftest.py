"""Fixtures of the vLLM 0.34 suite (run with the vllm034 venv: python -m pytest tests/vllm034).

As tests/vllm033 for 0.33: vLLM 0.34's CUDA wheel installs and imports on a CPU-only machine and
its Scheduler, connectors, offloading and tiering classes run on the CPU (its engine does not).
The suite runs the 0.33 suite's tests that apply to 0.34 (test_reused_033.py, and through it the
0.32 suite's) and its own (what 0.34 changed), with real gateway processes, on the 0.32 suite's
drivers (tests/vllm: harness.py, tiering_driver.py) and fixtures, by import.

A later release's suite is this file with its version and the reuse module of this one.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
VERSION = "0.34."
# the 0.33 suite's modules first, then the 0.32 suite's (harness.py and the tests they import)
for suite in ("vllm", "vllm033"):
    path = os.path.join(TESTS, suite)
    if path not in sys.path:
        sys.path.insert(0, path)

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402  (a missing vLLM is a failure of this suite, never a skip)

from suite_reuse import conftest_of, require_release  # noqa: E402

require_release("vllm034", "vLLM", vllm.__version__, VERSION, "requirements/vllm034.txt")
_c032 = conftest_of("vllm")
model_dir = _c032.model_dir          # the 0.32 suite's tiny checkpoints (fixtures, by import)
model_dir3 = _c032.model_dir3
