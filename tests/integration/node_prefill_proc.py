"""A prefill process for node tests: a PrefillNode over Mooncake TCP, driven by JSON lines.

    python node_prefill_proc.py '<json options>'

Prints ``{"event": "ready", ...}`` once registered, then reads commands from stdin:
``{"op": "room", "room": R, "generation": G, "tokens": N, "stall": false}`` runs the prefill side
of a room on every rank (``stall`` sends only the first chunk and never the last, so the room
stays mid-transfer); ``{"op": "stats"}`` prints the metrics. Each finished room prints
``{"event": "room", ...}``. With the option ``"gate_writes": true``, ``{"op": "hold_writes"}``
makes every later write wait, in flight for the node, until ``{"op": "release_writes"}``; each
write that starts waiting prints ``{"event": "write_held"}``, and every write handed to the
transport, held or not, ``{"event": "write_submitted"}``. ``"staging_slot_pages": N`` gives
each rank a staging slot of N pages (a decode of another TP size receives staged).
``"head_dim": D`` sets the page size in bytes (the decode's caches must have the same); a room
command's ``"fill_byte": B`` fills its pages with that byte instead of the room's pattern.
``{"op": "wedge", "rank": R, "seconds": S}`` makes rank R's next step that carries out an output
hang there, holding its endpoint lock, for S seconds (for ever without ``seconds``, until
``{"op": "unwedge"}``): a control loop stuck inside a step. It prints ``{"event": "wedged"}``
when the step starts hanging and ``{"event": "unwedged"}`` when it goes on.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup

from pdflow.chaos.prefill_agent import SourcePages
from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.outputs import Output
from pdflow.io.kv_buffers import HostKvCache, RankKv, host_cache_for_rank, staging_page_bytes
from pdflow.io.node_common import Effect, EndpointHost
from pdflow.io.node_prefill import PrefillNode, PrefillRank
from pdflow.io.settings import load_settings
from pdflow.transport.base import TransferOutcome, WriteOpLike
from pdflow.transport.mooncake import MooncakeTransport

sys.path.insert(0, os.path.dirname(__file__))
from node_kv_pattern import GEOMETRY, fill, page_view, pages_for
from proc_commands import emit, room_on_every_rank, run_main, serve_commands


class GatedTransport(MooncakeTransport):
    """Mooncake, except that writes wait while the gate is shut (the node sees them in flight)."""

    shut: anyio.Event | None = None

    async def batch_write(self, peer_session_id: str,
                          ops: Sequence[WriteOpLike]) -> TransferOutcome:  # fmt: skip
        emit(event="write_submitted")
        if self.shut is not None:
            emit(event="write_held")
            await self.shut.wait()
        return await super().batch_write(peer_session_id, ops)


class Wedge:
    """Hangs the next output one rank's step carries out (see the module's ``wedge``)."""

    def __init__(self) -> None:
        self.released = anyio.Event()

    def install(self, host: EndpointHost, seconds: float | None) -> None:
        dispatch = host._dispatch  # the rank's own dispatcher, wrapped for one output

        def hanging(output: Output, msg_id: str | None) -> Effect:
            host._dispatch = dispatch
            pending = dispatch(output, msg_id)
            return self._hang(pending, seconds)

        host._dispatch = hanging

    async def _hang(self, pending: Effect, seconds: float | None) -> None:
        emit(event="wedged")
        with anyio.move_on_after(math.inf if seconds is None else seconds):
            await self.released.wait()
        emit(event="unwedged")
        if pending is not None:
            await pending


async def run_rank(rank: PrefillRank, cache: HostKvCache, kv: RankKv, pool: SourcePages,
                   cmd: dict[str, Any]) -> str:  # fmt: skip
    room, tokens = cmd["room"], cmd["tokens"]
    await rank.open_room(room, cmd["generation"])
    status = await rank.wait(room)
    if status.poll is KVPoll.Failed:
        await rank.clear(room)
        return "failed"
    count = pages_for(tokens)
    pages = await pool.take(count)
    try:
        if cmd.get("fill_byte") is None:
            fill(cache, kv, room, pages)
        else:
            page_view(cache, kv)[:, pages] = cmd["fill_byte"]
        await rank.init_transfer(room, count)
        split = max(1, count // 2)
        if count > 1:
            await rank.send_chunk(room, pages[:split], False)
        if cmd.get("stall"):
            await anyio.sleep_forever()
        await rank.send_chunk(room, pages[split:] if count > 1 else pages, True)
        emit(event="chunks_sent", room=room, rank=rank.rank)
        final = await rank.wait(room, terminal=True)
        await rank.clear(room)
    finally:
        pool.give(pages)
    return final.poll.name


async def main(options: dict[str, Any]) -> None:
    settings = load_settings(**options.get("settings", {}))
    tp = options.get("tp", 2)
    num_pages = options.get("num_pages", 2048)
    geometry = {**GEOMETRY, "head_dim": options.get("head_dim", GEOMETRY["head_dim"])}
    caches = [host_cache_for_rank(tp_size=tp, tp_rank=r, num_pages=num_pages,
                                  dtype=KvDtype.FP16, **geometry) for r in range(tp)]  # fmt: skip
    transport = (GatedTransport if options.get("gate_writes") else MooncakeTransport).open()
    async with transport, PrefillNode(
        ranks=[kv for _, kv in caches], transport=transport, bootstrap=options["bootstrap"],
        settings=settings, serve_bootstrap=options.get("serve_bootstrap", True),
        staging_slot_bytes=options.get("staging_slot_pages", 0) * staging_page_bytes(
            caches[0][1].kv_buffers),
    ) as node:  # fmt: skip
        pools = [SourcePages(num_pages) for _ in range(tp)]
        wedge = Wedge()
        emit(event="ready", bootstrap=node.bootstrap, pid=os.getpid(),
             incarnation=node.incarnation, ranks=[r.peer.address for r in node.ranks],
             started_at=node.started_at, health=node.health)  # fmt: skip

        def handle(cmd: dict[str, Any], tasks: TaskGroup) -> None:
            async def one(index: int) -> str:
                cache, kv = caches[index]
                return await run_rank(node.ranks[index], cache, kv, pools[index], cmd)

            if cmd["op"] == "room":
                tasks.start_soon(room_on_every_rank, tp, cmd, one)
            elif cmd["op"] == "hold_writes" and isinstance(transport, GatedTransport):
                transport.shut = anyio.Event()
            elif cmd["op"] == "release_writes" and isinstance(transport, GatedTransport):
                if transport.shut is not None:
                    transport.shut.set()
                transport.shut = None
            elif cmd["op"] == "wedge":
                wedge.install(node.ranks[cmd["rank"]]._host, cmd.get("seconds"))
            elif cmd["op"] == "unwedge":
                wedge.released.set()
            elif cmd["op"] == "stats":
                emit(event="stats", metrics=node.metrics_text)

        await serve_commands(handle)


if __name__ == "__main__":
    run_main(main)
