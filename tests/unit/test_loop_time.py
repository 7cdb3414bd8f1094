"""loop_time(): the nodes' cheap read of anyio's clock must be anyio's clock on every backend."""

from __future__ import annotations

import anyio
import pytest

from pdflow.io.node_common import loop_time


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_loop_time_reads_the_clock_anyio_deadlines_use(backend: str) -> None:
    async def sandwich() -> tuple[float, float, float]:
        before = anyio.current_time()
        now = loop_time()
        return before, now, anyio.current_time()

    before, now, after = anyio.run(sandwich, backend=backend)
    # trio's clock has an offset of its own: only anyio's own clock lies between these.
    assert before <= now <= after
