"""vLLM 0.31's suite: every test of tests/vllm/release_suite.py (what runs: RELEASES["0.31"] there)."""

from release_suite import *  # noqa: F401,F403
