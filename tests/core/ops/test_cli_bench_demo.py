"""The README's main command (``adpkv demo``) and ``adpkv bench`` run end to end."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_stores_restarts_and_restores(tmp_path):
    out = subprocess.run([sys.executable, "-m", "adpkv_gateway.ops.cli", "demo", "--dir", str(tmp_path / "card"),
                          "--tokens", "4096", "--layers", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "16 of 16 chunks stored" in out.stdout
    assert "byte-exact: True" in out.stdout


def test_bench_prints_ratios(tmp_path):
    out = subprocess.run([sys.executable, "-m", "adpkv_gateway.ops.cli", "bench", "--dir", str(tmp_path / "b"),
                          "--sizes", "128KiB,1MiB", "--total", "16MiB", "--ranks", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert re.fullmatch(r"store_vs_raw=\d+\.\d\d restore_vs_raw=\d+\.\d\d \(cold 1 MiB\)", lines[-1]), lines[-1]
    assert sum(" GB/s" in line for line in lines) == 4      # 2 sizes x cold/hot
