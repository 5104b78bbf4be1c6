"""How a release's suite stands on another suite (tests/vllm026, vllm028-031 through
tests/vllm/release_suite.py, vllm033, vllm034, lmcache057): it refuses a venv of another release
(a failure of the suite, never a skip), and it takes the other suite's fixtures by loading that
suite's conftest.py under its own module name (both are named ``conftest``)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

TESTS = os.path.dirname(os.path.abspath(__file__))


def require_release(suite: str, package: str, installed: str, expected: str, requirements: str) -> None:
    """``RuntimeError`` unless ``installed`` (the venv's version of ``package``) starts with
    ``expected``: the suite ``suite`` runs against that release only."""
    if not installed.startswith(expected):
        raise RuntimeError(f"tests/{suite} runs against {package} {expected} ({requirements}), not {installed}")


def conftest_of(suite: str) -> ModuleType:
    """tests/<suite>/conftest.py, loaded as the module ``<suite>_conftest`` (its fixtures, for import)."""
    spec = importlib.util.spec_from_file_location(f"{suite}_conftest", os.path.join(TESTS, suite, "conftest.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
