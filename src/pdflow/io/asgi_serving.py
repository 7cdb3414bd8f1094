"""Serving an ASGI app on uvicorn inside the caller's task group, started and stopped cleanly.

Both HTTP servers of pdflow (the bootstrap registry and a prefill's own health endpoint) run
this way: on a bound socket (port 0 picks a free one), without uvicorn's signal handlers (the
shell owns them), stopping gracefully when the ``async with`` block ends whatever cancels it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import anyio
import uvicorn
from starlette.types import ASGIApp

_KEEP_ALIVE_S = 30
"""How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals both the
heartbeat's default interval and httpx's pool expiry, so a probe could go out on a connection
the server was closing that instant; longer than the client's expiry, the client always drops
an idle connection first."""


class _ShellServer(uvicorn.Server):
    """uvicorn without its signal handlers: the shell (e.g. ``pdflow bootstrap``) owns them."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int, what: str = "bootstrap server") -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it from ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot bind the {what} to {host}:{port}: "
                                 f"{exc.strerror}; pick another --port or stop the other "
                                 "server") from exc


def require_asyncio(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(f"the {what} runs on uvicorn, which needs anyio's asyncio "
                           "backend: anyio.run(main, backend='asyncio')") from None


@asynccontextmanager
async def serving(app: ASGIApp, listener: socket.socket, what: str) -> AsyncIterator[None]:
    """Serve ``app`` on ``listener`` until the block ends; the socket is closed on exit."""
    bound_host, bound_port = listener.getsockname()[:2]
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, access_log=False, http="h11",
        server_header=False, timeout_graceful_shutdown=2, timeout_keep_alive=_KEEP_ALIVE_S,
    )
    server = _ShellServer(config)
    serving_ended = anyio.Event()

    async def run_server() -> None:
        # Shielded: whatever cancels the caller, uvicorn still shuts down gracefully (stop
        # accepting, finish requests in flight) once ``should_exit`` is set below.
        try:
            with anyio.CancelScope(shield=True):
                await server.serve(sockets=[listener])
        finally:
            serving_ended.set()

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run_server)
            try:
                while not server.started:
                    if serving_ended.is_set():
                        raise RuntimeError(f"the {what} on {bound_host}:{bound_port} "
                                           "stopped before it started; see the log above")
                    await anyio.sleep(0.005)
                yield
            finally:
                server.should_exit = True
    finally:
        listener.close()
