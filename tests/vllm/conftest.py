"""Fixtures of the vLLM adapter tests (run with the vllm venv: python -m pytest tests/vllm)."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytest.importorskip("vllm", reason="the vLLM adapter tests need the vllm venv (tools/venv.sh vllm)")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny LlamaForCausalLM (2 layers, hidden 256, 2 KV heads of 64) with seeded random weights."""
    from engine_run import make_model
    return make_model(str(tmp_path_factory.mktemp("tiny-llama")), layers=2)


@pytest.fixture(scope="session")
def model_dir3(tmp_path_factory):
    """The same with 3 layers (a middle layer the EXIST of the end layers does not see)."""
    from engine_run import make_model
    return make_model(str(tmp_path_factory.mktemp("tiny-llama3")), layers=3)


@pytest.fixture(scope="session")
def baseline(model_dir):
    """Greedy outputs of the engine tests' prompts without any connector (one engine run)."""
    from engine_run import run_subprocess, engine_prompts
    results, _ = run_subprocess(model_dir, engine_prompts())
    assert all(r["cached"] == 0 for r in results)
    return [r["tokens"] for r in results]
