"""Fence by engine rotation, for real: a prefill killed -9 (or paused) with writes in flight
leaves its pages quarantined on a Mooncake TCP decode (no per-peer fence); rotating the decode's
engine gives them back without a restart, no late write lands in them, and new rooms are
served through the new engine."""

from __future__ import annotations

import ctypes
import signal
from typing import Any

import anyio
import numpy as np
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import staging_page_bytes
from pdflow.io.node_common import PagesHeld, PagesReleased, RoomStatus, WriterFenced
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

from .canaries import CANARY
from .node_harness import (
    DecodeEngine,
    decode_caches,
    decode_engine,
    prefill_process,
    sigstopped_prefill,
    wait_readmitted,
)
from .node_kv_pattern import GEOMETRY

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

HEARTBEAT_S, MAX_FAILURES = 0.5, 2
POOL = 512


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def node_settings(tmp: str, rotate_percent: float = 0.0, **more: Any) -> dict[str, Any]:
    return {"trace_dir": tmp, "checksum": True, "heartbeat_interval": HEARTBEAT_S,
            "heartbeat_max_failure": MAX_FAILURES,
            "rotate_quarantine_percent": rotate_percent, **more}  # fmt: skip


def quarantined(node: DecodeNode) -> int:
    return sum(len(q.pages) for rank in node.ranks for q in rank.quarantine())


async def serve_new_rooms(engine: DecodeEngine, prefill: Any, bootstrap: str,
                          rooms: range) -> None:  # fmt: skip
    for room in rooms:
        await prefill.start_room(room, 0, 48)
        with anyio.fail_after(15):
            assert await engine.run_room(bootstrap, room, 0, 48) == "Success"


async def test_kill_9_mid_transfer_then_the_quarantine_threshold_rotates_the_engine_and_frees_it(
    tmp_path: anyio.Path,
) -> None:
    """The setting, not a call, rotates: pages held for the dead prefill pass 5% of the pool."""
    settings = node_settings(str(tmp_path), rotate_percent=5.0)
    transport = MooncakeTransport.open()
    stalled_rooms = range(100, 120)
    async with anyio.create_task_group() as tasks, transport:
        async with decode_engine(tasks, transport, settings, num_pages=POOL) as engine:
            node = engine.node
            first_session = transport.session_id
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": POOL}
            async with prefill_process(tasks, options) as first:
                bootstrap = first.ready["bootstrap"]
                for room in range(5):
                    await first.start_room(room, 0, 64)
                    assert await engine.run_room(bootstrap, room, 0, 64) == "Success"
                outcomes: dict[int, str] = {}

                async def stalled_room(room: int) -> None:
                    await first.start_room(room, 0, 128, stall=True)
                    outcomes[room] = await engine.run_room(bootstrap, room, 0, 128)

                async with anyio.create_task_group() as rooms:
                    for room in stalled_rooms:
                        rooms.start_soon(stalled_room, room)
                    with anyio.fail_after(10):  # each stalled room wrote its first chunk
                        while sum(isinstance(e, RoomStatus) and e.room >= 100 and e.poll == 3
                                  for e in engine.events) < 2 * len(stalled_rooms):  # fmt: skip
                            await anyio.sleep(0.01)
                    first.kill()
                with anyio.fail_after(5):
                    await first.process.wait()
            assert set(outcomes.values()) == {"Failed"}
            with anyio.fail_after(10):
                while not node.rotations:
                    await anyio.sleep(0.02)
            [rotation] = node.rotations
            assert rotation.reason == "quarantine_threshold"
            assert rotation.old_session == first_session != rotation.new_session
            assert transport.session_id == rotation.new_session
            for rank in node.ranks:
                assert rank.quarantine() == () and rank.allocatable == POOL
            assert await engine.settled_leak_report() == []  # the engine has every page back
            held = sum(len(e.pages) for e in engine.events
                       if isinstance(e, PagesHeld) and e.room in stalled_rooms)  # fmt: skip
            assert rotation.released_pages == held > 0
            assert engine.order_of(WriterFenced) == []  # no per-peer fence was claimed
            await anyio.sleep(0.3)
            assert engine.written_after_release() == []
            options["bootstrap"] = bootstrap
            async with prefill_process(tasks, options) as second:
                await serve_new_rooms(engine, second, bootstrap, range(200, 210))
            assert engine.corrupt == []
            assert await engine.settled_leak_report() == []
            print(f"kill -9: rooms failed {len(outcomes)}, pages held {held}, released by "
                  f"rotation {rotation.released_pages} (drain {rotation.drain_s:.3f}s), "
                  f"late writes in released pages {len(engine.written_after_release())}")
        tasks.cancel_scope.cancel()


async def test_kill_9_of_a_staged_writer_rotates_however_few_pages_it_pins_in_the_ring(
    tmp_path: anyio.Path,
) -> None:
    """A staged decode (TP 1 behind a TP 2 prefill): one killed room pins its staging-ring
    region, far under the page threshold; the ring's watermark cannot pass it, so every later
    staged room would wait and fail (chaos finding 6). Any ring region held only for a dead
    writer rotates, and a restarted prefill is served staged again."""
    settings = node_settings(str(tmp_path), rotate_percent=50.0)
    caches = decode_caches(1, num_pages=POOL)
    ring_pages = 64
    transport = MooncakeTransport.open()
    async with anyio.create_task_group() as tasks, transport:
        async with DecodeNode(
            ranks=[kv for _, kv in caches], transport=transport,
            settings=load_settings(**settings),
            staging_bytes=ring_pages * staging_page_bytes(caches[0][1].kv_buffers),
        ) as node:  # fmt: skip
            engine = DecodeEngine(node, [cache for cache, _ in caches])
            tasks.start_soon(engine.pump)
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": POOL,
                       "staging_slot_pages": 8}  # fmt: skip
            async with prefill_process(tasks, options) as first:
                bootstrap = first.ready["bootstrap"]
                await serve_new_rooms(engine, first, bootstrap, range(3))
                outcome: list[str] = []

                async def stalled_room() -> None:
                    await first.start_room(100, 0, 128, stall=True)
                    outcome.append(await engine.run_room(bootstrap, 100, 0, 128))

                async with anyio.create_task_group() as rooms:
                    rooms.start_soon(stalled_room)
                    with anyio.fail_after(10):  # the writers' first chunks are landing
                        while not any(isinstance(e, RoomStatus) and e.room == 100
                                      and e.poll == 3 for e in engine.events):  # fmt: skip
                            await anyio.sleep(0.01)
                    await anyio.sleep(0.3)
                    first.kill()
                with anyio.fail_after(5):
                    await first.process.wait()
            assert outcome == ["Failed"]
            held = sum(len(e.pages) for e in engine.events
                       if isinstance(e, PagesHeld) and e.room == 100)  # fmt: skip
            assert 0 < held < POOL // 2  # far under the page threshold
            with anyio.fail_after(15):
                while not node.rotations:
                    await anyio.sleep(0.02)
            [rotation] = node.rotations
            assert rotation.reason == "quarantine_threshold" and rotation.released_pages == held
            [rank] = node.ranks
            assert rank.quarantine() == () and rank.allocatable == POOL
            options["bootstrap"] = bootstrap
            async with prefill_process(tasks, options) as second:
                # 16 rooms of 8 pages: twice round the ring, past where the killed region was.
                for room in range(200, 216):
                    await second.start_room(room, 0, 128)
                    with anyio.fail_after(15):
                        assert await engine.run_room(bootstrap, room, 0, 128) == "Success"
            assert engine.corrupt == [] and engine.verified == 3 + 16
            assert engine.written_after_release() == []
            assert await engine.settled_leak_report() == []
        tasks.cancel_scope.cancel()


async def test_a_writer_declared_dead_after_its_room_failed_still_rotates(
    tmp_path: anyio.Path,
) -> None:
    """The room times out first, its writer stopped but not yet declared dead (its pages held
    for the drain ACK); the writer is then killed and declared dead with no page held or
    released after that. The dead verdict alone must pass the threshold (chaos finding 6): the
    decode is quiet, so nothing else would ever check it again."""
    settings = node_settings(str(tmp_path), rotate_percent=1.0, waiting_timeout=1.0)
    transport = MooncakeTransport.open()
    async with anyio.create_task_group() as tasks, transport:
        async with decode_engine(tasks, transport, settings, num_pages=POOL) as engine:
            node = engine.node
            options = {"bootstrap": "127.0.0.1:0", "settings": node_settings(str(tmp_path)),
                       "num_pages": POOL}  # fmt: skip
            async with prefill_process(tasks, options) as first:
                bootstrap = first.ready["bootstrap"]
                await first.start_room(100, 0, 128, stall=True)
                failed = anyio.Event()

                async def stalled_room() -> None:
                    assert await engine.run_room(bootstrap, 100, 0, 128) == "Failed"
                    failed.set()

                tasks.start_soon(stalled_room)
                with anyio.fail_after(10):  # the writers' first chunks are landing
                    while not any(isinstance(e, RoomStatus) and e.room == 100
                                  and e.poll == 3 for e in engine.events):  # fmt: skip
                        await anyio.sleep(0.01)
                first.process.send_signal(signal.SIGSTOP)  # it cannot answer the ABORT
                with anyio.fail_after(5):  # the room's 1 s timer, far under the dead verdict
                    await failed.wait()
                held = quarantined(node)
                assert held == 2 * 8 and not node.rotations  # not declared dead: no rotation
                first.kill()
                with anyio.fail_after(5):
                    await first.process.wait()
            with anyio.fail_after(15):
                while not node.rotations:
                    await anyio.sleep(0.02)
            [rotation] = node.rotations
            assert rotation.reason == "quarantine_threshold" and rotation.released_pages == held
            assert await engine.settled_leak_report() == []
            assert engine.written_after_release() == []
        tasks.cancel_scope.cancel()


async def test_sigstop_then_reclaim_quarantine_frees_pages_and_the_resumed_writes_fail(
    tmp_path: anyio.Path,
) -> None:
    """A paused prefill declared dead: reclaim_quarantine rotates the engine while it is still
    paused; its held writes, released after SIGCONT, go to the destroyed engine and fail, and
    no byte lands in the released pages (canaries). It then serves new rooms through the new
    engine."""
    settings = node_settings(str(tmp_path))
    rooms = range(100, 108)
    async with sigstopped_prefill(settings, rooms) as paused:
        engine, prefill, bootstrap = paused.engine, paused.prefill, paused.bootstrap
        node, outcomes = engine.node, paused.outcomes
        held = quarantined(node)
        assert held > 0 and not engine.order_of(PagesReleased, room=rooms[0])
        with anyio.fail_after(30):
            rotation = await node.reclaim_quarantine()
        assert rotation.reason == "requested" and rotation.released_pages == held
        for rank in node.ranks:
            assert rank.quarantine() == () and rank.allocatable == 256
        prefill.process.send_signal(signal.SIGCONT)
        await prefill.send(op="release_writes")
        with anyio.fail_after(30):
            for room in rooms:
                await prefill.room_done[room].wait()
        await anyio.sleep(0.5)  # time for anything still on its way to land
        results = {room: prefill.rooms[room] for room in rooms}
        late = engine.written_after_release()
        print(f"SIGSTOP + rotation: rooms failed {len(outcomes)}, pages released by "
              f"rotation {rotation.released_pages}, prefill results {results}, late "
              f"writes in released pages {len(late)}")
        assert late == [], f"late writes landed in released pages: {late}"
        assert engine.landed_while_held == []
        await wait_readmitted(node)  # the same life, its ABORTs ACKed
        await serve_new_rooms(engine, prefill, bootstrap, range(200, 205))
        assert engine.corrupt == []
        assert await engine.settled_leak_report() == []
        assert engine.written_after_release() == []


WIRE_HEAD_DIM = 4096
"""With it a page is 512 KiB per buffer (16 tokens x 4 heads x 4096 x 2 bytes), so a chunk of
32 consecutive pages is one 16 MiB write op per buffer: tens of milliseconds on loopback."""
WIRE_FILL = 0x5A


def room_bytes(layout: Any, pages: list[int]) -> list[bytes]:
    """The bytes of a run of consecutive pages, buffer by buffer."""
    return [ctypes.string_at(layout.page_addr(b, pages[0]), len(pages) * layout.item_len)
            for b in range(len(layout.buffer_addrs))]  # fmt: skip


def written(layout: Any, pages: list[int]) -> int:
    """How many bytes of the run are no longer the canary."""
    canary = np.uint8(CANARY)
    return sum(int(np.count_nonzero(np.frombuffer(data, np.uint8) != canary))
               for data in room_bytes(layout, pages))  # fmt: skip


async def test_sigstop_inside_a_write_on_the_wire_rotation_cuts_it_before_the_pages_are_reused(
    tmp_path: anyio.Path,
) -> None:
    """The prefill is paused while its writes are on the wire: the decode's engine accepted
    them and part of their bodies landed. The heartbeat declares it dead, reclaim_quarantine
    rotates, and the pages are released and reused (the engine paints them) while it is
    still paused; after SIGCONT not one byte of the cut writes, or of any later one, lands in
    them. Only destroying the old engine cuts an accepted write: unregistering the memory
    from it, or a retire that does nothing, lets the rest land (this test goes red)."""
    settings = node_settings(str(tmp_path), checksum=False)
    count = 64  # two chunks of 32 pages: 4 ops of 16 MiB each
    pool = count + 8
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, tp=1, num_pages=pool,
                                 head_dim=WIRE_HEAD_DIM) as engine:  # fmt: skip
            node, [rank] = engine.node, engine.node.ranks
            layout = node.rank_kv[0].layout
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": pool,
                       "tp": 1, "head_dim": WIRE_HEAD_DIM}  # fmt: skip
            async with prefill_process(tasks, options) as prefill:
                bootstrap = prefill.ready["bootstrap"]
                await serve_new_rooms(engine, prefill, bootstrap, range(2))
                room, tokens = 100, count * GEOMETRY["page_size"]
                await prefill.start_room(room, 0, tokens, fill_byte=WIRE_FILL)
                await rank.open(room, 0, bootstrap)
                assert (await rank.wait(room)).poll is not KVPoll.Failed
                pages = engine.take_run(0, count)
                first_byte = layout.page_addr(0, pages[0])
                await rank.publish_pages(room, pages)
                with anyio.fail_after(30):
                    while ctypes.string_at(first_byte, 1) != bytes([WIRE_FILL]):
                        await anyio.sleep(0.0002)
                prefill.process.send_signal(signal.SIGSTOP)
                with anyio.fail_after(20):  # the heartbeat's verdict, interval x max failures
                    assert (await rank.wait(room, terminal=True)).poll is KVPoll.Failed
                await anyio.sleep(0.3)  # what was in the socket buffers has been read
                at_stop = written(layout, pages)
                total = count * layout.item_len * len(layout.buffer_addrs)
                assert 0 < at_stop < total, "the pause did not come inside the writes"
                assert [q.pages for q in rank.quarantine()] == [tuple(pages)]
                with anyio.fail_after(30):
                    rotation = await node.reclaim_quarantine()
                assert rotation.released_pages == count
                with anyio.fail_after(5):  # the engine has them back, painted with canaries
                    while not set(pages) <= set(engine.free[0]):
                        await anyio.sleep(0.01)
                assert written(layout, pages) == 0
                prefill.process.send_signal(signal.SIGCONT)
                with anyio.fail_after(30):
                    await prefill.room_done[room].wait()
                await anyio.sleep(0.5)  # anything still on its way has landed by now
                late = written(layout, pages)
                print(f"write on the wire: {at_stop} of {total} bytes landed before the pause, "
                      f"{late} in the reused pages after SIGCONT; prefill says "
                      f"{prefill.rooms[room]}")
                assert late == 0, f"{late} bytes of the cut writes landed in reused pages"
                assert prefill.rooms[room] == ["Failed"]
                await wait_readmitted(node)
                await serve_new_rooms(engine, prefill, bootstrap, range(200, 203))
            assert engine.corrupt == []
            assert engine.written_after_release() == []
            assert await engine.settled_leak_report() == []
        tasks.cancel_scope.cancel()
