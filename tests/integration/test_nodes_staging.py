"""Heterogeneous TP through the staging ring, end to end through both nodes: prefill TP=2 ->
decode TP=1, each prefill rank gathers its head slices and makes one bulk write per chunk, the
decode scatters them into its pages; the bytes must equal the per-head-slice path's."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.to_thread
import pytest

from pdflow.core.dataplane.checksum import ByteRange, Checksum
from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.dataplane.planning import StagedSlices, WriteOp
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.dataplane.executor import Executor
from pdflow.io.kv_buffers import HostKvCache, RankKv, default_executor, host_cache_for_rank
from pdflow.io.node_common import PagesReleased
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric
from tests.integration.canaries import Canaries
from tests.integration.node_kv_pattern import GEOMETRY, fill, matches

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

NUM_PAGES = 48
Caches = list[tuple[HostKvCache, RankKv]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def caches(tp: int) -> Caches:
    return [host_cache_for_rank(tp_size=tp, tp_rank=r, num_pages=NUM_PAGES, dtype=KvDtype.INT8,
                                **GEOMETRY) for r in range(tp)]  # fmt: skip


@asynccontextmanager
async def nodes(staging: bool, executor: Executor | None = None,
                ) -> AsyncIterator[tuple[PrefillNode, DecodeNode, Caches, Caches]]:  # fmt: skip
    settings = load_settings(trace_enabled=False, checksum=True)
    prefill, decode = caches(2), caches(1)
    page_bytes = 2 * GEOMETRY["num_layers"] * decode[0][1].layout.item_len
    fabric = InProcessFabric()
    async with (
        fabric.create_transport() as p_transport, fabric.create_transport() as d_transport,
        PrefillNode(ranks=[kv for _, kv in prefill], transport=p_transport,
                    bootstrap="127.0.0.1:0", settings=settings,
                    staging_slot_bytes=8 * page_bytes if staging else 0) as p_node,
        DecodeNode(ranks=[kv for _, kv in decode], transport=d_transport, settings=settings,
                   staging_bytes=16 * page_bytes if staging else 0,
                   executor=executor) as d_node,
    ):  # fmt: skip
        yield p_node, d_node, prefill, decode


async def start_room(p_node: PrefillNode, d_node: DecodeNode, prefill: Caches, room: int,
                     src: list[int], dst: list[int], chunk: int) -> None:  # fmt: skip
    for cache, kv in prefill:
        fill(cache, kv, room, src)
    for rank in p_node.ranks:
        await rank.open_room(room, 1)
    d_rank = d_node.ranks[0]
    await d_rank.open(room, 1, p_node.bootstrap)
    await d_rank.wait(room)
    await d_rank.publish_pages(room, dst)

    async def send(rank_index: int) -> None:
        rank = p_node.ranks[rank_index]
        await rank.wait(room)
        await rank.init_transfer(room, len(src))
        for start in range(0, len(src), chunk):
            pages = src[start : start + chunk]
            await rank.send_chunk(room, pages, is_last=start + chunk >= len(src))

    async with anyio.create_task_group() as tasks:
        for index in range(len(p_node.ranks)):
            tasks.start_soon(send, index)


async def run_room(p_node: PrefillNode, d_node: DecodeNode, prefill: Caches, room: int,
                   src: list[int], dst: list[int], chunk: int) -> KVPoll:  # fmt: skip
    await start_room(p_node, d_node, prefill, room, src, dst, chunk)
    d_rank = d_node.ranks[0]
    with anyio.fail_after(20):
        status = await d_rank.wait(room, terminal=True)
    return status.poll


async def test_staged_rooms_land_exactly_and_release_the_ring() -> None:
    async with nodes(staging=True) as (p_node, d_node, prefill, decode):
        events = d_node.subscribe()
        rooms = {7: ([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]), 8: ([6, 7, 8], [20, 22, 21])}
        for room, (src, dst) in rooms.items():
            poll = await run_room(p_node, d_node, prefill, room, src, dst, chunk=2)
            assert poll is KVPoll.Success
            assert matches(*decode[0], room, dst), f"room {room}: staged bytes differ"
            await d_node.ranks[0].clear(room)
            for rank in p_node.ranks:
                await rank.clear(room)
        endpoint = d_node.ranks[0]._host.endpoint
        assert endpoint.staging is not None and endpoint.staging.snapshot().live == ()
        released = 0
        with anyio.fail_after(5):
            async for event in events:
                if isinstance(event, PagesReleased):
                    released += len(event.pages)
                    if released == 8:
                        break


async def test_staged_and_per_slice_paths_leave_the_same_bytes() -> None:
    results = {}
    for staging in (True, False):
        async with nodes(staging=staging) as (p_node, d_node, prefill, decode):
            poll = await run_room(p_node, d_node, prefill, 3, [0, 1, 2], [5, 6, 7], chunk=3)
            assert poll is KVPoll.Success
            results[staging] = bytes(decode[0][0].memory)
    assert results[True] == results[False]


class HeldScatter:
    """The node's executor, with its staged scatter held until the test lets it go: the abort
    then lands in the verification window deterministically."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.entered = threading.Event()
        self.go = threading.Event()
        self.scattered = threading.Event()

    def write(self, ops: Sequence[WriteOp]) -> None:
        self.inner.write(ops)

    def gather(self, slices: StagedSlices) -> None:
        self.inner.gather(slices)

    def scatter(self, slices: StagedSlices) -> None:
        self.entered.set()
        assert self.go.wait(20), "the test never let the scatter go"
        self.inner.scatter(slices)
        self.scattered.set()

    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum:
        return self.inner.checksum(ranges)


async def test_an_abort_during_verification_frees_pages_only_after_the_scatter() -> None:
    # Chaos finding 5: the abort came while the checksum task scattered staged slices into the
    # room's pages; clear freed them at once and the scatter went on writing into them.
    held = HeldScatter(default_executor())
    async with nodes(staging=True, executor=held) as (p_node, d_node, prefill, decode):
        events = d_node.subscribe()
        d_rank = d_node.ranks[0]
        dst = [10, 11, 12, 13]
        await start_room(p_node, d_node, prefill, 5, [1, 2, 3, 4], dst, chunk=2)
        assert await anyio.to_thread.run_sync(held.entered.wait, 20), "no staged scatter ran"
        await d_rank.abort(5, "the client went away")
        with anyio.move_on_after(0.5):
            status = await d_rank.wait(5, terminal=True)
            assert status.poll is KVPoll.Failed
            await d_rank.clear(5)
        canaries = Canaries(decode[0][1].layout)
        released: list[int] = []

        def note_releases() -> None:
            while True:
                try:
                    event = events.receive_nowait()
                except anyio.WouldBlock:
                    return
                if isinstance(event, PagesReleased) and event.room == 5:
                    # Released: the engine hands them to another room, which fills them.
                    canaries.fill(event.pages)
                    released.extend(event.pages)

        note_releases()
        released_under_scatter = list(released)
        held.go.set()
        assert await anyio.to_thread.run_sync(held.scattered.wait, 20)
        with anyio.fail_after(20):
            while sorted(released) != dst:
                await anyio.sleep(0.01)
                note_releases()
        await anyio.sleep(0.1)  # anything still writing would land now
        assert canaries.damaged(dst) == [], "a released page was written after its release"
        assert released_under_scatter == [], "pages released while the scatter wrote them"
        summary = d_rank.snapshot()
        assert summary.ledger.free == NUM_PAGES


class BrokenScatter(HeldScatter):
    def scatter(self, slices: StagedSlices) -> None:
        raise RuntimeError("device lost")


async def test_a_verification_that_raises_still_reports_and_frees_the_pages() -> None:
    async with nodes(staging=True, executor=BrokenScatter(default_executor())) as (
        p_node, d_node, prefill, _decode,
    ):  # fmt: skip
        await start_room(p_node, d_node, prefill, 6, [1, 2], [20, 21], chunk=2)
        d_rank = d_node.ranks[0]
        with anyio.fail_after(20):
            status = await d_rank.wait(6, terminal=True)
        assert status.poll is KVPoll.Failed
        assert "local verification failed: RuntimeError: device lost" in status.reason
        await d_rank.clear(6)
        assert d_rank.snapshot().ledger.free == NUM_PAGES
