"""A chaos prefill instance: a PrefillNode (TP ranks in one process) over Mooncake TCP.

    python -m pdflow.chaos.prefill_agent '<json options>'

Prints ``{"event": "ready", ...}`` once registered. Commands on stdin: ``room`` (run the prefill
side of one room on every rank: fill its pages with the room's pattern, send them in chunks,
optionally abort after a delay), ``state`` (rooms still open), ``pause_at_write`` (the
``pause_mid_write`` fault: stop this process inside its next write to a host; see
:mod:`pdflow.chaos.mid_write_pause`) and ``quit``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio

from pdflow.chaos.agent_io import (
    clear_quietly,
    configure_logging,
    describe,
    emit,
    forgotten,
    serve_commands,
)
from pdflow.chaos.kv_pattern import fill, pages_for, rank_caches
from pdflow.chaos.mid_write_pause import WritePausingTransport
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import HostKvCache, RankKv, staging_page_bytes
from pdflow.io.node_prefill import PrefillNode, PrefillRank
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeConfig

MAX_CHUNK_PAGES = 4


class SourcePages:
    """One rank's free source pages; a room waits for enough of them."""

    def __init__(self, count: int) -> None:
        self.free = list(range(count))
        self.available = anyio.Event()

    async def take(self, count: int) -> list[int]:
        while len(self.free) < count:
            if self.available.is_set():
                self.available = anyio.Event()
            await self.available.wait()
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)
        self.available.set()


async def run_rank(rank: PrefillRank, cache: HostKvCache, kv: RankKv, pool: SourcePages,
                   cmd: dict[str, Any]) -> tuple[str, str]:  # fmt: skip
    room, generation = cmd["room"], cmd["generation"]
    await rank.open_room(room, generation)
    status = await rank.wait(room)
    if status.poll is KVPoll.Failed:
        await rank.clear(room)
        return ("Failed" if await forgotten(rank, room) else "NotForgotten"), status.reason
    count = pages_for(cmd["tokens"])
    pages = await pool.take(count)
    try:
        fill(cache, kv, room, generation, pages)
        await rank.init_transfer(room, count)
        chunk = max(1, min(MAX_CHUNK_PAGES, cmd.get("chunk_pages", 2)))
        for start in range(0, count, chunk):
            if rank.poll(room) in (KVPoll.Failed, KVPoll.Success):
                break
            await rank.send_chunk(room, pages[start : start + chunk], start + chunk >= count)
        final = await rank.wait(room, terminal=True)
        await rank.clear(room)
        done = await forgotten(rank, room)
    finally:
        pool.give(pages)
    return (final.poll.name if done else "NotForgotten"), final.reason


async def main(options: dict[str, Any]) -> None:
    settings = load_settings(**options["settings"])
    tp, num_pages = options["tp"], options["num_pages"]
    caches = rank_caches(tp, num_pages)
    slot = MAX_CHUNK_PAGES * staging_page_bytes(caches[0][1].kv_buffers)
    transport = await anyio.to_thread.run_sync(
        WritePausingTransport.open, MooncakeConfig(host=settings.host)
    )
    async with transport, PrefillNode(
        ranks=[kv for _, kv in caches], transport=transport, bootstrap=options["bootstrap"],
        settings=settings, serve_bootstrap=options["serve_bootstrap"], staging_slot_bytes=slot,
    ) as node:  # fmt: skip
        pools = [SourcePages(num_pages) for _ in range(tp)]
        emit(event="ready", bootstrap=node.bootstrap, pid=os.getpid(),
             incarnation=node.incarnation, ranks=[r.peer.address for r in node.ranks])  # fmt: skip

        async def room(cmd: dict[str, Any]) -> None:
            results: dict[int, tuple[str, str]] = {}

            async def one(index: int) -> None:
                cache, kv = caches[index]
                try:
                    results[index] = await run_rank(node.ranks[index], cache, kv, pools[index],
                                                    cmd)  # fmt: skip
                except Exception as exc:  # a refused call fails this rank's side of the room
                    results[index] = ("Refused", describe(exc))
                    await clear_quietly([node.ranks[index]], cmd["room"])

            async def abort_later(delay: float) -> None:
                await anyio.sleep(delay)
                for rank in node.ranks:
                    if rank.poll(cmd["room"]) not in (None, KVPoll.Failed, KVPoll.Success):
                        await rank.abort(cmd["room"], "chaos: the prefill side gave up")

            async with anyio.create_task_group() as ranks:
                if cmd.get("abort_after") is not None:
                    ranks.start_soon(abort_later, cmd["abort_after"])
                async with anyio.create_task_group() as sides:
                    for index in range(tp):
                        sides.start_soon(one, index)
                ranks.cancel_scope.cancel()
            ordered = [results[i] for i in range(tp)]
            emit(event="room", room=cmd["room"], generation=cmd["generation"],
                 results=[r for r, _ in ordered], reasons=[why for _, why in ordered])  # fmt: skip

        async def state(cmd: dict[str, Any]) -> None:
            open_rooms = [[s.room for s in rank.snapshot().rooms] for rank in node.ranks]
            emit(event="state", incarnation=node.incarnation, rooms_open=open_rooms)

        async def pause_at_write(cmd: dict[str, Any]) -> None:
            transport.arm(cmd["id"], cmd["host"])

        await serve_commands({"room": room, "state": state, "pause_at_write": pause_at_write})
    emit(event="stopped")


if __name__ == "__main__":
    configure_logging()
    anyio.run(main, json.loads(sys.argv[1]), backend="asyncio")
