"""A prefill process over Mooncake TCP whose transfer queue holds chunks of rooms the decode
aborted: those chunks are never handed to the transport, so each room's drain ACK (and the
decode's pages and staging-ring region with it) waits only for the writes already in flight.

Chaos finding 8 (docs/chaos.md): the prefill's queue for one decode rank held some 220 chunks
of rooms aborted long before, each failing after about a second against the decode's retired
engine; live rooms' chunks queued behind them for 84 s, and their regions pinned the staged
decode's ring until after the run."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import PagesReleased, RoomStatus
from pdflow.transport.mooncake import MooncakeTransport

from .node_harness import decode_engine, prefill_process, start_rooms

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

# The prefill node's default: the workers of its one transfer queue (transfer_queues 1 below).
LANES = 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def node_settings(tmp: str) -> dict[str, Any]:
    return {"trace_dir": tmp, "checksum": True, "heartbeat_interval": 0.5,
            "heartbeat_max_failure": 2, "transfer_queues": 1}  # fmt: skip


async def test_chunks_queued_behind_held_writes_of_an_aborted_room_are_never_submitted(
    tmp_path: anyio.Path,
) -> None:
    settings = node_settings(str(tmp_path))
    transport = MooncakeTransport.open()
    options = {"bootstrap": "127.0.0.1:0", "settings": settings, "gate_writes": True}
    rooms = range(10, 16)
    async with anyio.create_task_group() as tasks, transport:  # noqa: SIM117 - tasks first
        async with prefill_process(tasks, options) as prefill:
            bootstrap = prefill.ready["bootstrap"]
            async with decode_engine(tasks, transport, settings) as engine:
                node = engine.node
                await prefill.start_room(1, 0, 64)
                assert await engine.run_room(bootstrap, 1, 0, 64) == "Success"
                await prefill.send(op="hold_writes")
                with anyio.fail_after(10):
                    while prefill.counts["write_submitted"] < 2 * len(node.ranks):
                        await anyio.sleep(0.01)
                submitted_before = prefill.counts["write_submitted"]
                async with anyio.create_task_group() as group:
                    outcomes = start_rooms(group, engine, prefill, bootstrap, rooms)
                    # Two chunks per room and prefill rank: LANES writes held in flight, the
                    # rest queued behind them.
                    queued = 2 * len(rooms) * len(node.ranks)
                    with anyio.fail_after(20):
                        while (prefill.counts["chunks_sent"] < len(rooms) * len(node.ranks)
                               or prefill.counts["write_held"] < LANES):  # fmt: skip
                            await anyio.sleep(0.01)
                    assert prefill.counts["write_held"] == LANES < queued
                    for room_id in rooms:
                        for rank in node.ranks:
                            await rank.abort(room_id, "the test aborts it")
                    with anyio.fail_after(20):  # every ABORT reached the prefill's rooms
                        for room_id in rooms:
                            await prefill.room_done[room_id].wait()
                    await prefill.send(op="release_writes")
                assert outcomes == dict.fromkeys(rooms, "Failed")
                with anyio.fail_after(20):  # the drain ACKs came: every page is back
                    while not all(
                        any(isinstance(e, PagesReleased) and e.room == room_id
                            and e.rank == rank.rank for e in engine.events)
                        for room_id in rooms for rank in node.ranks
                    ):  # fmt: skip
                        await anyio.sleep(0.02)
                submitted = prefill.counts["write_submitted"] - submitted_before
                assert submitted == LANES, (
                    f"{submitted} writes of aborted rooms reached the transport; only the "
                    f"{LANES} already in flight when the ABORTs came may"
                )
                assert engine.written_after_release() == []
                assert await engine.settled_leak_report() == []
                # The decode serves again at once (its rooms fail only by the test's ABORT).
                await prefill.start_room(2, 0, 64)
                assert await engine.run_room(bootstrap, 2, 0, 64) == "Success"
                failed = [e for e in engine.events if isinstance(e, RoomStatus)
                          and e.poll is KVPoll.Failed and e.room not in rooms]  # fmt: skip
                assert failed == []
            tasks.cancel_scope.cancel()
