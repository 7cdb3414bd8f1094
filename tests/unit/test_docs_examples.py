"""The Python examples in the docs run as written (docs stay true to the code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    found = []
    for doc in sorted(DOCS.glob("*.md")):
        for index, code in enumerate(BLOCK.findall(doc.read_text(encoding="utf-8"))):
            found.append((f"{doc.name}#{index}", code))
    return found


@pytest.mark.parametrize(("where", "code"), _examples(), ids=[w for w, _ in _examples()])
def test_doc_example_runs(where: str, code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, where, "exec"), {"__name__": "__doc_example__"})
    if where.startswith("getting-started"):
        assert "SUCCESS" in capsys.readouterr().out
