"""What every chaos agent process shares: JSON lines on stdout, commands on stdin, logs on
stderr (the harness sends each process's stderr to its own log file)."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import structlog

Handler = Callable[[dict[str, Any]], Awaitable[None]]
FORGET_TIMEOUT_S = 20.0
MUTANT_VARIABLE = "PDFLOW_CHAOS_MUTANT"
"""Names a deliberately broken build of an agent (see decode_agent), for showing the checker
goes red."""


class RoomRank(Protocol):
    def poll(self, room: int) -> Any: ...


async def forgotten(rank: RoomRank, room: int) -> bool:
    """Wait until the rank forgot the room (a failed room drains after ``clear``): only then may
    its id be opened again at the next generation. False if it is still there after 20 s."""
    with anyio.move_on_after(FORGET_TIMEOUT_S):
        while rank.poll(room) is not None:
            await anyio.sleep(0.05)
        return True
    return False


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def configure_logging() -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper("iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


async def stdin_commands() -> AsyncIterator[dict[str, Any]]:
    """Each JSON command line on stdin (blank lines skipped) until ``{"op": "quit"}`` or the
    end of input."""
    async for line in anyio.wrap_file(sys.stdin):
        if not line.strip():
            continue
        command: dict[str, Any] = json.loads(line)
        if command["op"] == "quit":
            return
        yield command


async def serve_commands(handlers: dict[str, Handler]) -> None:
    """Run each command in its own task until ``quit`` or the end of stdin."""
    async with anyio.create_task_group() as tasks:
        async for command in stdin_commands():
            tasks.start_soon(_guarded, handlers[command["op"]], command)
        tasks.cancel_scope.cancel()


def describe(exc: BaseException) -> str:
    """The exception, or for a group the exceptions inside it."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


async def clear_quietly(ranks: Sequence[Any], room: int) -> None:
    """After a refused call: clear the room wherever it is still open, so its id can be used
    again once it is forgotten (what an engine does when a request errors)."""
    for rank in ranks:
        if rank.poll(room) is not None:
            with contextlib.suppress(Exception):
                await rank.clear(room)


async def _guarded(handler: Handler, command: dict[str, Any]) -> None:
    try:
        await handler(command)
    except Exception as exc:  # one command's failure is reported, the process keeps serving
        error = describe(exc)
        emit(event="error", op=command["op"], room=command.get("room"),
             generation=command.get("generation"), error=error)  # fmt: skip
