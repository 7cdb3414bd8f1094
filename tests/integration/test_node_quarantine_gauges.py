"""The decode node's quarantine gauges, refreshed on every page release, never walk the rooms:
with thousands of reserved rooms on the rank, a refresh visits none of them (counted, not timed).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.protocol.messages import PeerId
from pdflow.core.resources.page_ledger import Fence, Reserve
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
from test_room_scaling import VisitCountingDict

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

GEOMETRY: dict[str, Any] = {"num_layers": 1, "page_size": 4, "head_dim": 8, "total_kv_heads": 1,
            "dtype": KvDtype.FP16}  # fmt: skip
ROOMS = 3000
WRITER = PeerId("127.0.0.1:1", "w1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_refreshing_the_quarantine_gauges_visits_no_room(tmp_path: anyio.Path) -> None:
    settings = load_settings(env={}, trace_dir=str(tmp_path), trace_enabled=False)
    _memory, kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=ROOMS + 2, **GEOMETRY)
    fabric = InProcessFabric()
    async with fabric.create_transport() as transport, DecodeNode(
        ranks=[kv], transport=transport, settings=settings
    ) as node:
        ledger = node.ranks[0]._host.endpoint.ledger
        for room in range(ROOMS):
            ledger.handle(Reserve(room, 0, (room,)), 0.0)
        ledger.handle(Fence(0, 0, (WRITER,)), anyio.current_time() - 5.0)
        for name in ("_rooms", "_fenced"):
            if hasattr(ledger, name):
                setattr(ledger, name, VisitCountingDict(getattr(ledger, name)))
        VisitCountingDict.visited = 0
        node.update_quarantine()
        assert VisitCountingDict.visited == 0
        metrics = node.runtime.metrics
        assert metrics.value("pdflow_quarantined_pages") == 1
        assert 5.0 <= metrics.value("pdflow_quarantine_oldest_age_seconds") < 60.0
