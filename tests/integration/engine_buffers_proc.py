"""A prefill process whose ranks hand pdflow the engine's own KV buffers (engine_buffers.py),
over Mooncake TCP, driven by JSON lines like node_prefill_proc.py.

    python engine_buffers_proc.py '<json options: bootstrap, settings, model, tp, num_pages,
                                    is_mla, staging_slot_bytes>'

``{"op": "room", "room": R, "generation": G, "tokens": N}`` runs the prefill side of a room on
every rank (two chunks when it has two pages or more) and prints ``{"event": "room", ...}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import anyio
import structlog

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_prefill import PrefillNode, PrefillRank
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

sys.path.insert(0, os.path.dirname(__file__))
from engine_buffers import EngineKv, pages_for, source_pages


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


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
    ) as node:  # fmt: skip
        emit(event="ready", bootstrap=node.bootstrap, pid=os.getpid())

        async def room(cmd: dict[str, Any]) -> None:
            results: list[str] = []

            async def one(index: int) -> None:
                results.append(await run_rank(node.ranks[index], engines[index], num_pages, cmd))

            async with anyio.create_task_group() as ranks:
                for index in range(tp):
                    ranks.start_soon(one, index)
            emit(event="room", room=cmd["room"], results=sorted(results))

        async with anyio.create_task_group() as tasks:
            async for line in anyio.wrap_file(sys.stdin):
                if not line.strip():
                    continue
                cmd = json.loads(line)
                if cmd["op"] == "room":
                    tasks.start_soon(room, cmd)
                elif cmd["op"] == "quit":
                    break
            tasks.cancel_scope.cancel()
        emit(event="stopped")


if __name__ == "__main__":
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    anyio.run(main, json.loads(sys.argv[1]), backend="asyncio")
