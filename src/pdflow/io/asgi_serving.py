"""Serving an ASGI app on uvicorn inside the caller's task group, started and stopped cleanly.

Both HTTP servers of pdflow (the bootstrap registry and a prefill's own health endpoint) run
this way: on a bound socket (port 0 picks a free one), without uvicorn's signal handlers (the
shell owns them), stopping gracefully when the ``async with`` block ends whatever cancels it.

Each connection holds a file descriptor, and uvicorn on its own holds a connection that never
sends a complete request for ever (its keep-alive timer only runs between requests): 2,000
silent connections exhausted a server under ``ulimit -n 256``. So (:class:`ServingLimits`) a
server holds at most :func:`connection_cap` connections (a new one past it evicts the oldest
still waiting for its headers; uvicorn's ``limit_concurrency`` answers 503 past as many requests
in flight), a connection that has not sent a request's headers within ``header_timeout_s`` of
connecting (or of the first byte of its next request) is closed, and a request whose body has
not arrived within ``body_timeout_s`` of its headers gets 408 and its connection is closed
(:class:`RequestTimeout`).
"""

from __future__ import annotations

import asyncio
import resource
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import anyio
import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

_KEEP_ALIVE_S = 30
"""How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals both the
heartbeat's default interval and httpx's pool expiry, so a probe could go out on a connection
the server was closing that instant; longer than the client's expiry, the client always drops
an idle connection first."""


MAX_CONNECTIONS = 1024
"""Open connections (and requests in flight: uvicorn's ``limit_concurrency``) a server holds at
most: each connection is a file descriptor. A registry's clients are its prefill ranks and the
decodes (each of their ranks heartbeats a registry that serves a prefill's /health), each
keeping a connection or two; an idle kept-alive one is closed first when the cap is reached."""
HEADER_TIMEOUT_S = 10.0
"""How long a connection may take to send a request's headers: from its connection, or from
the first byte of its next request on a kept-alive connection."""
BODY_TIMEOUT_S = 10.0
"""How long a request's body may take to arrive, counted from its headers (bodies here are at
most a few KB)."""


@dataclass(frozen=True)
class ServingLimits:
    """What one client may hold of a server: connections, and time to send a request."""

    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 2:
            raise ValueError(f"max_connections must be at least 2, got {self.max_connections}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header_timeout_s and body_timeout_s must be positive seconds")


class RequestTimeout(Exception):
    """A request's body did not arrive within ``body_timeout_s``: raised by ``receive()``. An
    app that reads bodies answers it: ``TIMEOUT_STATUS`` with ``TIMEOUT_HEADERS`` (408, close)."""


TIMEOUT_STATUS = 408
TIMEOUT_HEADERS = {"Connection": "close"}
"""A 408 closes the connection: the rest of the body may still be on its way."""


def connection_cap(limits: ServingLimits) -> int:
    """How many connections a server holds: ``limits.max_connections``, and never more than an
    eighth of the file descriptors this process may open (``ulimit -n``). A flood briefly holds
    up to four times as many (asyncio accepts up to the backlog, the cap too, each loop turn,
    and the evicted ones close a turn or two later), and the process needs its descriptors for
    more than this server."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(2, min(limits.max_connections, soft // 8))


def _protocol_with_deadlines(limits: ServingLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a request's headers in
    time, and holding at most :func:`connection_cap` connections: a connection arriving past it
    evicts the oldest one still waiting for its headers (a silent or slow one: a client sends its
    request as soon as it connects), or is itself closed when every connection is busy. So a
    flood of silent connections neither exhausts the descriptors nor locks other clients out."""
    cap = connection_cap(limits)
    awaiting: dict[H11Protocol, None] = {}  # waiting for a request's headers, oldest first
    idle: dict[H11Protocol, None] = {}  # kept alive between requests, oldest first

    class DeadlinedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                # A connection that never sent its headers goes first (a flood's); one kept
                # alive by a client that was served only when there is none.
                oldest = next(iter(awaiting), None) or next(iter(idle), None)
                if oldest is None:
                    transport.close()
                    return
                oldest._headers_arrived()  # type: ignore[attr-defined]
                oldest.transport.close()
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # (the rest of) a request's headers is due
                self._await_headers()
            else:
                self._headers_arrived()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_arrived()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # Kept alive between requests: closed when the cap is reached and no silent
                # connection is left to close (the client opens a new connection for its next
                # request), else by uvicorn's keep-alive timer. Without this, as many idle
                # clients as the cap (a heartbeat per decode rank) turned every new one away.
                idle[self] = None

        def _await_headers(self) -> None:
            idle.pop(self, None)
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(limits.header_timeout_s,
                                                          self._headers_too_late)
                awaiting[self] = None

        def _headers_arrived(self) -> None:
            awaiting.pop(self, None)
            idle.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_late(self) -> None:
            self._header_timer = None
            awaiting.pop(self, None)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return DeadlinedH11Protocol


class _BodyDeadline:
    """ASGI middleware: ``receive()`` raises :class:`RequestTimeout` once the request's body has
    not arrived within ``deadline_s`` of its headers (uvicorn waits for it for ever)."""

    def __init__(self, app: ASGIApp, deadline_s: float) -> None:
        self.app = app
        self.deadline_s = deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = anyio.current_time() + self.deadline_s
        body_done = False
        response_started = False

        async def bounded_receive() -> Message:
            nonlocal body_done
            if body_done:  # after the body only a disconnect comes: no deadline for that
                return await receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
                body_done = message["type"] != "http.request" or not message.get("more_body")
                return message
            raise RequestTimeout(f"Request Timeout: the request body did not arrive within "
                                 f"{self.deadline_s:g} s of its headers")

        async def tracked_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except RequestTimeout as timeout:  # an app that did not answer it itself
            if response_started:
                raise
            await send({"type": "http.response.start", "status": TIMEOUT_STATUS,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": str(timeout).encode()})


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
async def serving(
    app: ASGIApp, listener: socket.socket, what: str, limits: ServingLimits = ServingLimits()
) -> AsyncIterator[None]:
    """Serve ``app`` on ``listener`` until the block ends; the socket is closed on exit."""
    bound_host, bound_port = listener.getsockname()[:2]
    config = uvicorn.Config(
        _BodyDeadline(app, limits.body_timeout_s), lifespan="off", log_config=None,
        access_log=False, http=_protocol_with_deadlines(limits), server_header=False,
        timeout_graceful_shutdown=2, timeout_keep_alive=_KEEP_ALIVE_S,
        # Connections are capped by the protocol, so this 503s only past as many requests in
        # flight. The backlog is also how many connections asyncio accepts in one go, before
        # any is evicted (a few loop turns later): the default (2,048) ran a flood into EMFILE
        # under ``ulimit -n 256``.
        limit_concurrency=connection_cap(limits) + 1, backlog=connection_cap(limits),
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
