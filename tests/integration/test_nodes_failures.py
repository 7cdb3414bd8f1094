"""Failures for real: kill -9 of the prefill mid-transfer, restart, a paused (SIGSTOP) prefill
declared dead while alive, and abort storms."""

from __future__ import annotations

import random
import signal
import time
from typing import Any

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import PagesHeld, PagesReleased, RoomStatus, WriterFenced
from pdflow.transport.mooncake import MooncakeTransport

from .node_harness import (
    decode_engine,
    prefill_process,
    sigstopped_prefill,
    stall_then_kill,
    start_rooms,
    wait_readmitted,
)
from .node_kv_pattern import pages_for

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

HEARTBEAT_S, MAX_FAILURES = 0.5, 2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def node_settings(tmp: str) -> dict[str, Any]:
    return {"trace_dir": tmp, "checksum": True, "heartbeat_interval": HEARTBEAT_S,
            "heartbeat_max_failure": MAX_FAILURES}  # fmt: skip


async def test_kill_9_mid_transfer_fails_rooms_quarantines_their_pages_and_a_restart_serves(
    tmp_path: anyio.Path,
) -> None:
    settings = node_settings(str(tmp_path))
    transport = MooncakeTransport.open()
    async with anyio.create_task_group() as tasks, transport:
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            node = engine.node
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512}
            async with prefill_process(tasks, options) as first:
                bootstrap = first.ready["bootstrap"]
                # Warm rooms succeed; stalled rooms have written their first chunk only.
                for room in range(10):
                    await first.start_room(room, 0, 64)
                    assert await engine.run_room(bootstrap, room, 0, 64) == "Success"
                stalled, killed_at = await stall_then_kill(engine, first, bootstrap,
                                                           range(100, 120))  # fmt: skip
                with anyio.fail_after(5):
                    await first.process.wait()
            failed_within = time.monotonic() - killed_at
            assert set(stalled.values()) == {"Failed"}
            assert failed_within < HEARTBEAT_S * MAX_FAILURES + 2
            # Mooncake TCP cannot fence on the receiving side (fence_is_real is False), and a
            # killed writer never ACKs: each stalled room's pages stay quarantined, reported
            # and kept from admission, never freed on the heartbeat's verdict.
            await anyio.sleep(HEARTBEAT_S * MAX_FAILURES)
            assert engine.order_of(WriterFenced) == []
            for rank_index, rank in enumerate(node.ranks):
                held = {e.room: e.pages for e in engine.events
                        if isinstance(e, PagesHeld) and e.rank == rank.rank}  # fmt: skip
                assert set(held) == set(range(100, 120)), rank.rank
                assert not [e for e in engine.events if isinstance(e, PagesReleased)
                            and e.rank == rank.rank and e.room >= 100]  # fmt: skip
                assert {q.room: q.pages for q in rank.quarantine()} == held
                quarantined = sum(len(pages) for pages in held.values())
                assert rank.allocatable == 512 - quarantined
                assert len(engine.free[rank_index]) == 512 - quarantined

            options["bootstrap"] = bootstrap  # the restarted prefill takes the same address
            async with prefill_process(tasks, options) as second:
                assert second.ready["incarnation"] != first.ready["incarnation"]
                for room in range(200, 220):
                    await second.start_room(room, 0, 48)
                    with anyio.fail_after(15):
                        assert await engine.run_room(bootstrap, room, 0, 48) == "Success"
            assert engine.corrupt == []
        tasks.cancel_scope.cancel()


async def test_abort_storm_never_reuses_a_page_a_write_can_still_reach(
    tmp_path: anyio.Path,
) -> None:
    rng = random.Random(7)
    settings = node_settings(str(tmp_path))
    # A small pool: aborted rooms' pages must come back (by ACK) before later rooms can run.
    transport = MooncakeTransport.open()
    async with anyio.create_task_group() as tasks, transport:
        options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 1024}
        async with prefill_process(tasks, options) as prefill:
            bootstrap = prefill.ready["bootstrap"]
            async with decode_engine(tasks, transport, settings, num_pages=160) as engine:
                outcomes: dict[int, str] = {}

                async def room(room_id: int, abort: bool) -> None:
                    tokens = rng.randint(16, 256)
                    await prefill.start_room(room_id, 0, tokens)
                    delay = rng.uniform(0, 0.01) if abort else None
                    outcomes[room_id] = await engine.run_room(bootstrap, room_id, 0, tokens,
                                                              abort_after=delay)  # fmt: skip

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as rooms:
                        for room_id in range(300):
                            rooms.start_soon(room, room_id, room_id % 2 == 0 and room_id < 200)
                    for room_id in range(300):
                        await prefill.room_done[room_id].wait()
                aborted = [r for r in range(0, 200, 2)]
                assert all(outcomes[r] == "Success" for r in range(300) if r not in aborted)
                assert any(outcomes[r] == "Failed" for r in aborted)
                assert engine.order_of(PagesHeld), "no abort caught a room mid-transfer"
                assert engine.corrupt == []
                assert engine.verified == 2 * sum(v == "Success" for v in outcomes.values())
                assert await engine.settled_leak_report() == []
                assert engine.written_after_release() == []
        tasks.cancel_scope.cancel()


async def test_sigstop_past_the_heartbeat_lands_no_late_write_in_a_released_page(
    tmp_path: anyio.Path,
) -> None:
    """The prefill is paused (SIGSTOP) with its writes in flight for longer than heartbeat
    interval x max failures: the decode fails its rooms while it is alive. After SIGCONT the
    held writes land; none may land in a page the decode released, and the resumed prefill
    serves new rooms. Mooncake TCP has no receiver-side fence, so the pages must wait for the
    resumed prefill's drain ACKs."""
    settings = node_settings(str(tmp_path))
    rooms = range(100, 108)
    async with sigstopped_prefill(settings, rooms) as paused:
        engine, prefill, bootstrap = paused.engine, paused.prefill, paused.bootstrap
        node, outcomes = engine.node, paused.outcomes
        await anyio.sleep(HEARTBEAT_S * MAX_FAILURES)  # more verdicts, still paused
        paused_for = time.monotonic() - paused.stopped_at
        assert paused_for > 2 * HEARTBEAT_S * MAX_FAILURES
        released_while_paused = engine.order_of(PagesReleased)
        assert not [i for i in released_while_paused if engine.events[i].room in rooms]
        prefill.process.send_signal(signal.SIGCONT)
        await prefill.send(op="release_writes")
        with anyio.fail_after(30):
            for room in rooms:
                await prefill.room_done[room].wait()
            while not all(engine.order_of(PagesReleased, room=room, rank=rank)
                          for room in rooms for rank in (0, 1)):  # fmt: skip
                await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # time for anything still on its way to land
        late = engine.written_after_release()
        pages_released = sum(len(e.pages) for e in engine.events
                             if isinstance(e, PagesReleased) and e.room in rooms)
        print(f"paused {paused_for:.2f}s: rooms failed {len(outcomes)}, pages released "
              f"{pages_released}, late writes landed in pages still quarantined "
              f"{len(engine.landed_while_held)}, in released pages {len(late)}")
        assert late == [], f"late writes landed in released pages: {late}"
        assert engine.landed_while_held, "no held write landed: the test tested nothing"
        assert engine.order_of(WriterFenced) == []
        await wait_readmitted(node)
        for room in range(200, 205):  # the resumed prefill serves new rooms
            await prefill.start_room(room, 0, 48)
            with anyio.fail_after(15):
                assert await engine.run_room(bootstrap, room, 0, 48) == "Success"
        assert engine.corrupt == []
        assert await engine.settled_leak_report() == []
        assert engine.written_after_release() == []


async def test_a_restart_seen_only_by_its_new_incarnation_frees_none_of_the_old_lifes_pages(
    tmp_path: anyio.Path,
) -> None:
    """The prefill is killed -9 mid-transfer and restarted on the same bootstrap address before
    the heartbeat's failures reach their limit: the decode learns of it from the incarnation
    its probe answers with. The old life's rooms fail and it is superseded (never readmitted),
    but the restart is no fence: over Mooncake its pages stay quarantined (no WriterFenced, no
    PagesReleased), and the new life serves new rooms."""
    settings = {**node_settings(str(tmp_path)), "heartbeat_max_failure": 40}  # 20 s of failures
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            node = engine.node
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512}
            async with prefill_process(tasks, options) as first:
                bootstrap = first.ready["bootstrap"]
                for room in range(3):
                    await first.start_room(room, 0, 64)
                    assert await engine.run_room(bootstrap, room, 0, 64) == "Success"
                options["bootstrap"] = bootstrap
                stalled = range(100, 106)
                async with anyio.create_task_group() as group:
                    outcomes = start_rooms(group, engine, first, bootstrap, stalled, 128,
                                           stall=True)  # fmt: skip
                    with anyio.fail_after(10):
                        while len(engine.order_of(RoomStatus, poll=KVPoll.Transferring)) < (
                            2 * len(stalled)
                        ):
                            await anyio.sleep(0.01)
                    first.kill()
                    with anyio.fail_after(5):
                        await first.process.wait()
                    async with prefill_process(tasks, options) as second:
                        with anyio.fail_after(15):  # the new incarnation's first answer
                            while len(outcomes) < len(stalled):
                                await anyio.sleep(0.02)
                        assert set(outcomes.values()) == {"Failed"}
                        for rank in node.ranks:
                            counters = rank.snapshot().counters
                            assert counters["heartbeat_failures"] < 40, "not the failure limit"
                            assert rank.snapshot().superseded == (first.ready["incarnation"],)
                        await anyio.sleep(4 * HEARTBEAT_S)  # more probes answered by the new life
                        held = {(e.rank, e.room) for e in engine.events
                                if isinstance(e, PagesHeld) and e.room in stalled}  # fmt: skip
                        assert held == {(rank.rank, room) for rank in node.ranks
                                        for room in stalled}  # fmt: skip
                        assert not [e for e in engine.events if isinstance(e, PagesReleased)
                                    and e.room in stalled]  # fmt: skip
                        assert engine.order_of(WriterFenced) == []
                        assert sum(len(q.pages) for r in node.ranks for q in r.quarantine()) == (
                            2 * len(stalled) * pages_for(128)
                        )
                        for room in range(200, 205):
                            await second.start_room(room, 0, 48)
                            with anyio.fail_after(15):
                                assert await engine.run_room(bootstrap, room, 0, 48) == "Success"
            assert engine.corrupt == []
            assert engine.written_after_release() == []
        tasks.cancel_scope.cancel()
