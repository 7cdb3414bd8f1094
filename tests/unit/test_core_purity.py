"""The core stays pure: no clock, randomness, threads, sockets or async in src/pdflow/core."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "src" / "pdflow" / "core"
FORBIDDEN = {
    "time", "random", "socket", "threading", "asyncio", "anyio", "trio", "zmq", "datetime",
    "secrets", "subprocess", "multiprocessing", "select", "selectors", "uuid", "os", "httpx",
    "structlog", "logging", "torch", "numpy", "triton",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_core_imports_nothing_impure() -> None:
    offenders = {
        str(path.relative_to(CORE)): sorted(_imports(path) & FORBIDDEN)
        for path in sorted(CORE.rglob("*.py"))
        if _imports(path) & FORBIDDEN
    }
    assert offenders == {}


def test_core_imports_nothing_from_the_layers_above() -> None:
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(
                    ("pdflow.io", "pdflow.sim", "pdflow.trace", "pdflow.cli", "pdflow.demo",
                     "pdflow.transport")
                ), f"{path.name} imports {node.module}"


def test_the_purity_check_would_catch_a_clock(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom random import random\n")
    assert _imports(bad) & FORBIDDEN == {"time", "random"}
