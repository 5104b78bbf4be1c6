"""Issue 38 item 9: the SDK example of docs/internals.md ("A complete example") runs as written
against a real gateway, as a separate process, and says what the docs say it says."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "internals.md"


def _example() -> str:
    text = DOC.read_text()
    section = text.split("### A complete example (runnable)", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_sdk_example_of_the_docs_runs_against_a_gateway(gateway, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_example())
    for run, existed in ((1, "[False, False, False, False]"), (2, "[True, True, True, True]")):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ADPKV_PORT": str(gateway.port)})
        assert out.returncode == 0, (run, out.stdout, out.stderr)
        assert out.stdout.splitlines() == [f"stored [True, True, True, True] existed {existed}",
                                           "exist [True, True, True, True]",
                                           "restored 4 objects byte-exact"], (run, out.stdout)
