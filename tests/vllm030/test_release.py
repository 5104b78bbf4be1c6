"""vLLM 0.30's suite: every test of tests/vllm/release_suite.py (what runs: RELEASES["0.30"] there)."""

from release_suite import *  # noqa: F401,F403
