"""Issue 38 item 8: ``tools/venv.sh`` never re-points a shared venv's editable install at another
checkout (it used to follow whichever checkout ran it last, switching the code a running suite of
the first checkout imports); each checkout gets its own import tree for PYTHONPATH instead."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[3]


def _checkout(root: pathlib.Path, name: str) -> pathlib.Path:
    co = root / name
    (co / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "venv.sh", co / "tools" / "venv.sh")
    (co / "requirements").mkdir()
    shutil.copy(REPO / "requirements" / "core.txt", co / "requirements" / "core.txt")
    for d in ("adpkv_core", "gateway", "plugins/vllm", "plugins/lmcache", "plugins/sglang"):
        (co / d).mkdir(parents=True)
    return co


def _fake_venv(root: pathlib.Path, log: pathlib.Path) -> pathlib.Path:
    """A built venv as venv.sh leaves it (its stamp matches), whose python logs its arguments."""
    venv = root / "venvs" / "core"
    (venv / "bin").mkdir(parents=True)
    stamp = hashlib.sha256((REPO / "requirements" / "core.txt").read_bytes()).hexdigest()[:16]
    (venv / ".adpkv-stamp").write_text(stamp + "\n")
    py = venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    py.chmod(0o755)
    return venv


def _venv_sh(co: pathlib.Path, root: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(co / "tools" / "venv.sh"), "core"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "ADPKV_VENV_ROOT": str(root / "venvs")})


def test_a_second_checkout_does_not_repoint_the_shared_venv(tmp_path):
    assert not (REPO / "requirements" / "core.post.sh").exists()      # the stamp above is the file's alone
    log = tmp_path / "pip.log"
    venv = _fake_venv(tmp_path, log)
    a, b = _checkout(tmp_path, "a"), _checkout(tmp_path, "b")
    for co in (a, b, a):
        out = _venv_sh(co, tmp_path)
        assert out.returncode == 0 and out.stdout.strip() == str(venv), out.stderr
    installs = [line for line in log.read_text().splitlines() if " -e " in f" {line} "]
    assert installs and all(line.endswith(f"-e {a}") for line in installs), installs
    assert "editable install stays on" in _venv_sh(b, tmp_path).stderr
    for co in (a, b):                   # each checkout's own import tree
        assert os.path.realpath(co / ".adpkv-src" / "adpkv_gateway") == str(co / "gateway")
        assert os.path.realpath(co / ".adpkv-src" / "adpkv_vllm") == str(co / "plugins" / "vllm")
    shutil.rmtree(a)                    # the owner is gone: the next checkout takes the install
    log.write_text("")
    assert _venv_sh(b, tmp_path).returncode == 0
    assert log.read_text().strip().endswith(f"-e {b}"), log.read_text()
