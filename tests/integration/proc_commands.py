"""What the node-test subprocesses share: JSON events on stdout, commands on stdin, one room
run on every rank at once, logs on stderr."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from pdflow.chaos.agent_io import emit, stdin_commands


async def serve_commands(handle: Callable[[dict[str, Any], TaskGroup], None]) -> None:
    """Hand every stdin command to ``handle`` until ``{"op": "quit"}`` or end of input."""
    async with anyio.create_task_group() as tasks:
        async for cmd in stdin_commands():
            handle(cmd, tasks)
        tasks.cancel_scope.cancel()
    emit(event="stopped")


async def room_on_every_rank(ranks: int, cmd: dict[str, Any],
                             one: Callable[[int], Awaitable[str]]) -> None:  # fmt: skip
    """Run ``one(index)`` for every rank at once; emit the room's sorted outcomes."""
    results: list[str] = []

    async def run(index: int) -> None:
        results.append(await one(index))

    async with anyio.create_task_group() as group:
        for index in range(ranks):
            group.start_soon(run, index)
    emit(event="room", room=cmd["room"], results=sorted(results))


def run_main(main: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    # stdout carries the JSON events; logs go to stderr, warnings and up only.
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    anyio.run(main, json.loads(sys.argv[1]), backend="asyncio")
