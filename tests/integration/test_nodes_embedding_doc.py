"""The example in docs/embedding.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DOC = Path(__file__).parents[2] / "docs" / "embedding.md"


def test_the_embedding_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1, "docs/embedding.md should hold exactly one python example"
    namespace: dict[str, object] = {"__name__": "embedding_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    result: dict[str, Any] = anyio.run(namespace["main"], backend="asyncio")  # type: ignore[arg-type]
    assert result["status"] == "Success"
    assert result["free_pages"] == 64
    assert result["first_token"] == 1234, "the aux row landed in the decode's slot by Success"
    assert 'pdflow_rooms_total{outcome="success"} 1.0' in result["metrics"]
