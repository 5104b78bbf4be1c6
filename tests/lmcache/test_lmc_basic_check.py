"""LMCache's own conformance check (`python -m lmcache.v1.basic_check --mode test_l2_adapter`; LMCache
0.5.7 moved it to `lmcache.inprocess.v1.basic_check`) on our adapter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest


def _check_module() -> str:
    """Where this LMCache has its basic check (0.5.6: lmcache.v1; 0.5.7: lmcache.inprocess.v1)."""
    import importlib.util
    for name in ("lmcache.v1.basic_check", "lmcache.inprocess.v1.basic_check"):
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            continue
    raise AssertionError("this LMCache has no basic_check module")


def _run_check(port: int, *extra: str) -> str:
    spec = {"type": "plugin", "module_path": "adpkv_lmcache", "class_name": "AdpL2Adapter",
            # a fresh namespace per run: basic_check's keys repeat across runs under PYTHONHASHSEED=0
            "adapter_params": {"port": port, "namespace": f"basic-check-{uuid.uuid4().hex[:8]}"}}
    cmd = [sys.executable, "-m", _check_module(), "--mode", "test_l2_adapter",
           "--l2-adapter", json.dumps(spec), *extra]
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _assert_all_pass(stdout: str, n: int) -> None:
    # basic_check prints failures but exits 0, so read its verdicts
    assert "Test Failed" not in stdout, stdout
    assert f"Validation: {n}/{n} correctly absent" in stdout, stdout
    assert "Batch store OK" in stdout, stdout
    assert f"Validation: {n}/{n} found" in stdout, stdout
    assert f"Validation (loaded): {n}/{n}" in stdout, stdout
    assert f"Validation (content): {n}/{n}" in stdout, stdout
    rows = re.findall(r"\|\s*(LOOKUP \(absent\)|STORE|LOOKUP \(exist\)|LOAD)\s*\|.*?\|\s*(\d+)/(\d+)\s*\|", stdout)
    assert len(rows) == 4 and all(a == b for _, a, b in rows), stdout


@pytest.mark.parametrize("extra,n", [((), 5), (("--num-keys", "16", "--obj-size", "262144",
                                                 "--kv-dtype", "bfloat16"), 16)])
def test_lmcache_basic_check_passes(lmc_gateway, extra, n):
    _assert_all_pass(_run_check(lmc_gateway.port, *extra), n)
