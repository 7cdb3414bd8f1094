"""Small-room staging end to end through both nodes (equal TP): with the decode's
``small_room_staging_bytes`` on, the prefill gathers a small chunk's pages from every buffer
into its slot and makes ONE write into the decode's staging ring; the decode scatters it into
the room's pages before Success. The bytes must equal the direct path's, and the ring must be
empty once the rooms ended."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import EngineMemory, HostKvCache, RankKv, host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric
from pdflow.transport.base import TransferOutcome, Transport
from tests.integration.node_kv_pattern import GEOMETRY, fill, matches

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

NUM_PAGES = 32
Cache = tuple[HostKvCache, RankKv]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def cache() -> Cache:
    return host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=NUM_PAGES, dtype=KvDtype.INT8,
                               **GEOMETRY)  # fmt: skip


class CountedWrites:
    """The prefill transport's ``batch_write``, noting how many ops each call carried."""

    def __init__(self, transport: Transport) -> None:
        self.calls: list[int] = []
        self._inner = transport.batch_write
        transport.batch_write = self  # type: ignore[method-assign]

    async def __call__(self, session: str, ops: Sequence[Any]) -> TransferOutcome:
        self.calls.append(len(ops))
        return await self._inner(session, ops)


@asynccontextmanager
async def nodes(small_room_bytes: int, prefill_slots: bool = True) -> AsyncIterator[
        tuple[PrefillNode, DecodeNode, Cache, Cache, CountedWrites]]:  # fmt: skip
    """``prefill_slots=False``: a prefill with no staging slot, as a device-memory prefill
    whose engine lends no staging memory (its KV here stays in host memory: an engine that
    lends its own staging memory and asks for no slots gets the same node)."""
    settings = load_settings(trace_enabled=False, small_room_staging_bytes=small_room_bytes)
    prefill, decode = cache(), cache()
    no_slots: dict[str, Any] = (
        {} if prefill_slots
        else {"staging_memory": EngineMemory(prefill[0].base_addr, 1), "staging_slot_bytes": 0}
    )  # fmt: skip
    fabric = InProcessFabric()
    async with (
        fabric.create_transport() as p_transport, fabric.create_transport() as d_transport,
        PrefillNode(ranks=[prefill[1]], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings, **no_slots) as p_node,
        DecodeNode(ranks=[decode[1]], transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        yield p_node, d_node, prefill, decode, CountedWrites(p_transport)


async def run_room(p_node: PrefillNode, d_node: DecodeNode, prefill: Cache, room: int,
                   src: list[int], dst: list[int], chunk: int) -> KVPoll:  # fmt: skip
    fill(*prefill, room, src)
    p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
    await p_rank.open_room(room, 1)
    await d_rank.open(room, 1, p_node.bootstrap)
    await d_rank.wait(room)
    await d_rank.publish_pages(room, dst)
    await p_rank.wait(room)
    await p_rank.init_transfer(room, len(src))
    for start in range(0, len(src), chunk):
        await p_rank.send_chunk(room, src[start : start + chunk],
                                is_last=start + chunk >= len(src))  # fmt: skip
    with anyio.fail_after(20):
        status = await d_rank.wait(room, terminal=True)
    await d_rank.clear(room)
    await p_rank.clear(room)
    return status.poll


def page_bytes(kv: RankKv) -> int:
    return kv.kv_buffers.page_bytes


ROOMS = {3: ([1, 2, 3], [9, 4, 12], 2), 4: ([5], [20], 1), 5: ([6, 7, 8, 10], [1, 2, 3, 5], 4)}


async def test_small_rooms_go_as_one_write_per_chunk_and_land_exactly() -> None:
    buffers = 2 * GEOMETRY["num_layers"]
    async with nodes(small_room_bytes=4 * page_bytes(cache()[1])) as (
        p_node, d_node, prefill, decode, writes,
    ):  # fmt: skip
        for room, (src, dst, chunk) in ROOMS.items():
            assert await run_room(p_node, d_node, prefill, room, src, dst, chunk) is KVPoll.Success
            assert matches(*decode, room, dst), f"room {room}: staged bytes differ"
        endpoint = d_node.ranks[0]._host.endpoint
        assert endpoint.staging is not None and endpoint.staging.snapshot().live == ()
    # Rooms 3 (two chunks), 4 and 5: one write per chunk, whatever the number of buffers.
    assert writes.calls == [1, 1, 1, 1], f"{buffers} buffers: {writes.calls}"


async def test_rooms_over_the_limit_and_nodes_without_it_write_every_buffer() -> None:
    results = {}
    for limit_pages in (0, 2):
        async with nodes(small_room_bytes=limit_pages * page_bytes(cache()[1])) as (
            p_node, d_node, prefill, decode, writes,
        ):  # fmt: skip
            src, dst, chunk = ROOMS[5]
            assert await run_room(p_node, d_node, prefill, 5, src, dst, chunk) is KVPoll.Success
            assert matches(*decode, 5, dst)
            # Pages 6, 7, 8 -> 1, 2, 3 run on both sides; 10 -> 5 is a second run: 2 per buffer.
            assert writes.calls == [2 * 2 * GEOMETRY["num_layers"]]
            results[limit_pages] = bytes(decode[0].memory)
    assert results[0] == results[2]


async def test_a_prefill_without_staging_slots_gets_its_small_rooms_written_directly() -> None:
    # It registers no slot, so the decode places no region: every buffer is written directly
    # and the room succeeds (before the declaration the chunk failed: "the decode placed a
    # staging region for this chunk but this prefill has no staging slots").
    async with nodes(small_room_bytes=4 * page_bytes(cache()[1]), prefill_slots=False) as (
        p_node, d_node, prefill, decode, writes,
    ):  # fmt: skip
        assert p_node.staging_base is None
        src, dst, chunk = ROOMS[5]
        assert await run_room(p_node, d_node, prefill, 5, src, dst, chunk) is KVPoll.Success
        assert matches(*decode, 5, dst)
        assert writes.calls == [2 * 2 * GEOMETRY["num_layers"]]
        endpoint = d_node.ranks[0]._host.endpoint
        assert endpoint.staging is not None and endpoint.staging.snapshot().live == ()
