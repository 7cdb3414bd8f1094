"""A live prefill falsely declared dead while its write is in flight (in-process fabric, both
nodes real): once the decode releases a page, no byte of that write may land in it.

The write is held in flight by the fabric, the registry's /health is made to fail until the
decode gives up on the prefill, then the write is released. With a receiver-side fence the
decode releases the pages at once and the fabric refuses the write; without one (the fabric
modelling Mooncake) the pages stay quarantined until the prefill's drain ACK, and the write
lands while they are still held.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.bootstrap_client import BootstrapClient, HealthStatus
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_common import NodeEvent, PagesHeld, PagesReleased, WriterFenced
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric

sys.path.insert(0, os.path.dirname(__file__))
from canaries import Canaries

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

GEOMETRY: dict[str, Any] = {"num_layers": 2, "page_size": 4, "head_dim": 8, "total_kv_heads": 4,
            "dtype": KvDtype.FP16}  # fmt: skip
PAGES = (2, 3)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RegistryStall:
    """Every /health probe fails while ``stalled`` (the prefill itself stays alive)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stalled = False
        real = BootstrapClient.health

        async def health(client: BootstrapClient) -> HealthStatus:
            if self.stalled:
                return HealthStatus(False, None, "503: injected registry stall")
            return await real(client)

        monkeypatch.setattr(BootstrapClient, "health", health)


@pytest.mark.parametrize("receiver_fence", [True, False], ids=["fence", "no_fence"])
async def test_a_held_write_of_a_falsely_dead_writer_never_lands_in_a_released_page(
    tmp_path: anyio.Path, monkeypatch: pytest.MonkeyPatch, receiver_fence: bool
) -> None:
    stall = RegistryStall(monkeypatch)
    settings = load_settings(env={}, trace_dir=str(tmp_path), heartbeat_interval=0.05,
                             heartbeat_max_failure=2)  # fmt: skip
    fabric = InProcessFabric(receiver_fence=receiver_fence)
    p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=16, **GEOMETRY)
    _d_memory, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=16, **GEOMETRY)
    ctypes.memset(p_cache.base_addr, 0x5A, p_cache.nbytes)
    canaries = Canaries(d_kv.layout)
    canaries.fill(range(16))
    events: list[NodeEvent] = []
    landed_while_held: list[int] = []
    released: set[int] = set()
    async with (
        fabric.create_transport() as p_transport, fabric.create_transport() as d_transport,
        PrefillNode(ranks=[p_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings) as p_node,
        DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings) as d_node,
        anyio.create_task_group() as tasks,
    ):  # fmt: skip

        async def engine() -> None:
            async with d_node.subscribe() as stream:
                async for event in stream:
                    events.append(event)
                    if isinstance(event, PagesReleased):
                        # The engine takes the pages back: whatever landed until now was in a
                        # page still held; from here on the canary must stay.
                        landed_while_held.extend(canaries.damaged(event.pages))
                        canaries.fill(event.pages)
                        released.update(event.pages)

        tasks.start_soon(engine)
        d_rank, p_rank = d_node.ranks[0], p_node.ranks[0]
        await p_rank.open_room(1, 0)
        await d_rank.open(1, 0, p_node.bootstrap)
        await d_rank.wait(1)
        hold = fabric.hold_writes(d_transport.session_id)
        await d_rank.publish_pages(1, PAGES)
        await p_rank.wait(1)
        await p_rank.init_transfer(1, 2)
        await p_rank.send_chunk(1, [4, 5], True)
        with anyio.fail_after(5):
            await hold.wait_for_writer()
        stall.stalled = True
        with anyio.fail_after(5):
            assert (await d_rank.wait(1, terminal=True)).poll is KVPoll.Failed
            while not any(isinstance(e, PagesHeld) for e in events):
                await anyio.sleep(0.01)
        if receiver_fence:
            with anyio.fail_after(5):
                while not released:
                    await anyio.sleep(0.01)
        else:
            await anyio.sleep(0.3)  # many heartbeat verdicts: none may release the pages
            assert not released, "pages released on a heartbeat verdict without a fence"
            assert d_rank.allocatable == 16 - len(PAGES)
            assert [q.pages for q in d_rank.quarantine()] == [PAGES]
        stall.stalled = False
        hold.release()
        with anyio.fail_after(5):
            await p_rank.wait(1, terminal=True)
            while not released:  # without a fence: freed by the prefill's drain ACK
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)
        assert canaries.damaged(released) == [], "a write landed in a released page"
        assert released == set(PAGES)
        fenced = [i for i, e in enumerate(events) if isinstance(e, WriterFenced)]
        freed = [i for i, e in enumerate(events) if isinstance(e, PagesReleased)]
        if receiver_fence:
            assert fenced and fenced[0] < freed[0]
            assert landed_while_held == []
        else:
            assert fenced == []
            assert landed_while_held == list(PAGES), "the late write should land, held"
        tasks.cancel_scope.cancel()
