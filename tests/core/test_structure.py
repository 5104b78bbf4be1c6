"""The gateway's subsystems import only those below them (``adpkv_gateway.LAYERS``), adpkv_core's
memory imports nothing of adpkv_core and its wire nothing of the client, and no product folder
holds more than 12 modules: read from the source (an AST walk over every import, those inside
functions and under TYPE_CHECKING too), so a new import that runs up the layers fails here,
naming the file and the import."""

from __future__ import annotations

import ast
import pathlib

import adpkv_core
import adpkv_gateway

GATEWAY = pathlib.Path(adpkv_gateway.__file__).resolve().parent
CORE = pathlib.Path(adpkv_core.__file__).resolve().parent
MAX_MODULES = 12


def _package(path: pathlib.Path) -> str:
    """The subsystem of a gateway file: its top folder, or its name for a top-level module."""
    rel = path.relative_to(GATEWAY)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_packages(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, subsystem) of every import of ``adpkv_gateway.<subsystem>...`` in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "adpkv_gateway":
                continue
            if len(parts) > 1:
                out.append((node.lineno, parts[1]))
            else:          # from adpkv_gateway import <subsystem>, ...
                out += [(node.lineno, a.name) for a in node.names if a.name != "LAYERS"]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[1]) for a in node.names
                    if a.name.startswith("adpkv_gateway.")]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append((node.lineno, f"relative import (level {node.level})"))
    return out


def test_layers_are_a_strict_order():
    seen: set[str] = set()
    for name, below in adpkv_gateway.LAYERS:
        assert below <= seen, f"{name} may import {sorted(below - seen)}, which are not below it"
        seen.add(name)


def test_every_import_runs_down_the_layers():
    allowed = dict(adpkv_gateway.LAYERS)
    files = sorted(p for p in GATEWAY.rglob("*.py") if p.name != "__init__.py" or p.parent != GATEWAY)
    assert files
    bad = []
    for path in files:
        pkg = _package(path)
        assert pkg in allowed, f"{path.relative_to(GATEWAY)}: subsystem {pkg} is not in adpkv_gateway.LAYERS"
        for line, target in _imported_packages(path):
            if target != pkg and target not in allowed[pkg]:
                bad.append(f"{path.relative_to(GATEWAY)}:{line} ({pkg}) imports {target}")
    assert not bad, "imports against adpkv_gateway.LAYERS:\n" + "\n".join(bad)


def _core_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module under adpkv_core) of every absolute import of adpkv_core in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("adpkv_core"):
            mod = node.module[len("adpkv_core"):].lstrip(".")
            out += [(node.lineno, f"{mod}.{a.name}" if mod else a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append((node.lineno, "relative import"))
    return out


def test_core_memory_and_wire_stay_below_the_client():
    allowed = {"memory": ("memory.",), "wire": ("memory.", "wire.", "keys.")}
    bad = []
    for pkg, ok in allowed.items():
        for path in sorted((CORE / pkg).glob("*.py")):
            for line, target in _core_imports(path):
                if not target.startswith(ok):
                    bad.append(f"{path.relative_to(CORE)}:{line} imports adpkv_core.{target}")
    assert not bad, "\n".join(bad)


def test_no_folder_holds_more_than_12_modules():
    products = [GATEWAY, CORE] + [CORE.parent / "plugins" / p for p in ("vllm", "lmcache", "sglang")]
    for top in products:
        for folder in [top] + [p for p in top.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            assert len(modules) <= MAX_MODULES, f"{folder.relative_to(top.parent)}: {len(modules)} modules"


def test_the_walk_tool_traces_a_real_save_and_restore():
    """docs/internals.md's walk figures come from tools/request_walk.py: it runs a real gateway
    and client, checks the restored bytes, and prints the files each walk crossed; the store's
    parts are on both walks, the card's module on each, and the data path's sender (BATCH and
    DONE leave from the data path, not through the loop)."""
    import re
    import subprocess
    import sys

    tool = CORE.parent / "tools" / "request_walk.py"
    run = subprocess.run([sys.executable, str(tool), "--show"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = re.findall(r"^(save|restore): (\d+) files crossed, (\d+) steps, (\d+) returns", run.stdout, re.M)
    assert [f[0] for f in figures] == ["save", "restore"], run.stdout
    walks = [line for line in run.stdout.splitlines() if line.startswith("  ")]
    for (_, files, steps, returns), walk in zip(figures, walks):
        assert 20 <= int(files) <= int(steps) and int(returns) < int(steps)
        for part in ("gateway/store/object_store.py", "gateway/store/card_io.py", "gateway/cards/fs/card.py",
                     "gateway/datapath/transfers.py", "gateway/datapath/replies.py"):
            assert part in walk, part
