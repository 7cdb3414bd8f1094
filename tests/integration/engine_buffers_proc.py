"""A prefill process whose ranks hand pdflow the engine's own KV buffers (engine_buffers.py),
over Mooncake TCP, driven by JSON lines like node_prefill_proc.py.

    python engine_buffers_proc.py '<json options: bootstrap, settings, model, tp, num_pages,
                                    is_mla, staging_slot_bytes, pp_size, pp_rank,
                                    serve_bootstrap>'

With ``pp_size`` > 1 the process is one pipeline stage (its model holds that stage's layers).

``{"op": "room", "room": R, "generation": G, "tokens": N}`` runs the prefill side of a room on
every rank (two chunks when it has two pages or more) and prints ``{"event": "room", ...}``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from anyio.abc import TaskGroup

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_prefill import PrefillNode, PrefillPlacement, PrefillRank
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

sys.path.insert(0, os.path.dirname(__file__))
from engine_buffers import EngineKv, pages_for, source_pages
from proc_commands import emit, room_on_every_rank, run_main, serve_commands


async def run_rank(rank: PrefillRank, engine: EngineKv, num_pages: int,
                   cmd: dict[str, Any]) -> str:  # fmt: skip
    room = cmd["room"]
    await rank.open_room(room, cmd["generation"])
    if (await rank.wait(room)).poll is KVPoll.Failed:
        await rank.clear(room)
        return "failed"
    count = pages_for(cmd["tokens"])
    pages = source_pages(room, count, num_pages)
    engine.fill(room, pages)
    await rank.init_transfer(room, count)
    split = max(1, count // 2)
    if count > 1:
        await rank.send_chunk(room, pages[:split], False)
    await rank.send_chunk(room, pages[split:] if count > 1 else pages, True)
    final = await rank.wait(room, terminal=True)
    await rank.clear(room)
    return final.poll.name


async def main(options: dict[str, Any]) -> None:
    tp, num_pages = options["tp"], options["num_pages"]
    engines = [EngineKv(options["model"], tp, r, num_pages) for r in range(tp)]
    transport = MooncakeTransport.open()
    async with transport, PrefillNode(
        ranks=[engine.kv for engine in engines], transport=transport,
        bootstrap=options["bootstrap"], settings=load_settings(**options["settings"]),
        is_mla=options.get("is_mla", False),
        staging_slot_bytes=options.get("staging_slot_bytes", 0),
        serve_bootstrap=options.get("serve_bootstrap", True),
        placement=PrefillPlacement(pp_size=options.get("pp_size", 1),
                                   pp_rank=options.get("pp_rank", 0)),
    ) as node:  # fmt: skip
        emit(event="ready", bootstrap=node.bootstrap, pid=os.getpid())

        def handle(cmd: dict[str, Any], tasks: TaskGroup) -> None:
            async def one(index: int) -> str:
                return await run_rank(node.ranks[index], engines[index], num_pages, cmd)

            if cmd["op"] == "room":
                tasks.start_soon(room_on_every_rank, tp, cmd, one)

        await serve_commands(handle)


if __name__ == "__main__":
    run_main(main)
