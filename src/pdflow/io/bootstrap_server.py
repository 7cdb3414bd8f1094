"""The HTTP bootstrap server: SGLang's routes on Starlette + uvicorn, decisions in core.Registry.

This module only parses requests into registry inputs and serialises the registry's replies; it
passes ``now`` from a monotonic clock, the token from the request headers and, with each
registration, the wall clock it arrived at (``received_at``: a ``started_at`` far ahead of it is
refused). Routes, fields, texts and status codes follow SGLang's bootstrap server, so either
side's clients work against the other's server. Differences: readiness counts distinct ranks,
and a malformed request gets 400 with a message saying what is wrong (SGLang answers 500).

The order of the checks: the route and method (404, 405), then, with a token set, the token
(401) before anything of the request is read, so a request without it learns nothing of the
schema; then the media type (415), the body's size (413) and the time it takes to arrive (408,
see :mod:`pdflow.io.asgi_serving`), its nesting (``MAX_JSON_DEPTH``) and fields (400), and
last the registry's own answers. A handler failure is a bug: it is answered with a 500 that keeps
the connection open and logged with its traceback, without the frames' local variables and with
the token blanked out. A client that disconnects mid-request is logged quietly.

uvicorn runs on asyncio, so :func:`serve` needs anyio's asyncio backend.
"""

from __future__ import annotations

import socket
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdflow.core.cluster.registry import (
    DEFAULT_DP_RANK_TTL_S,
    MISSING_INPUTS,
    CheckHealth,
    QueryDpRanks,
    QueryRank,
    QueryTopology,
    RegisterDpRank,
    RegisterRank,
    Registry,
    Reply,
    route_query,
    unauthorized_reply,
)
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.io.asgi_serving import (
    TIMEOUT_HEADERS,
    TIMEOUT_STATUS,
    RequestTimeout,
    ServingLimits,
    bind,
    require_asyncio,
    serving,
)
from pdflow.io.health_server import WedgeAnswer, Wedged, healthy
from pdflow.io.json_guard import JSON_MEDIA_TYPE, MAX_JSON_DEPTH, is_json, nesting_depth

DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_TICK_INTERVAL_S = 5.0
INCARNATION_HEADER = "X-Pdflow-Incarnation"
TOKEN_HEADER = "X-Pdflow-Token"
ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")

log = structlog.get_logger("pdflow.bootstrap")


class _Refusal(Exception):
    """A request the HTTP layer cannot turn into a registry input."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class _DpRankBody(msgspec.Struct, frozen=True):
    bootstrap_room: int
    dp_rank: int


class _DpQueryBody(msgspec.Struct, frozen=True):
    bootstrap_rooms: list[int]


# ---- request -> input ---------------------------------------------------------------------------
def request_token(request: Request) -> str | None:
    """The shared token: ``X-Pdflow-Token``, else ``Authorization: Bearer <token>``."""
    direct = request.headers.get(TOKEN_HEADER)
    if direct:
        return direct
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Refusal(413, f"Request body too large: {declared} bytes, the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Refusal(413, f"Request body too large: over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_object(request: Request, limit: int) -> dict[str, Any]:
    if not is_json(request.headers.get("content-type")):
        shown = request.headers.get("content-type", "none")[:100]
        raise _Refusal(415, f"Unsupported Media Type: the body must be JSON sent with "
                            f"Content-Type: {JSON_MEDIA_TYPE} (got {shown})")
    body = await _read_body(request, limit)
    if nesting_depth(body) > MAX_JSON_DEPTH:
        raise _Refusal(400, f"Malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise _Refusal(400, f"Malformed JSON body: {exc}") from None
    if not isinstance(payload, dict):
        raise _Refusal(400, f"The body must be a JSON object, got {type(payload).__name__}")
    return payload


def _convert(payload: dict[str, Any], kind: type[Any], what: str) -> Any:
    try:
        return msgspec.convert(payload, kind)
    except msgspec.ValidationError as exc:
        raise _Refusal(400, f"Malformed {what}: {exc}") from None


async def registration_of(
    request: Request, limit: int, wall_clock: Callable[[], float] = time.time
) -> RegisterRank:
    payload = await _json_object(request, limit)
    # The token is a header and the arrival time the server's own clock: a body must not be
    # able to claim either (nor pick the input type).
    for stamped in ("token", "type"):
        payload.pop(stamped, None)
    reg: RegisterRank = _convert(payload, RegisterRank, "registration")
    return msgspec.structs.replace(reg, token=request_token(request), received_at=wall_clock())


def guarded_kind(request: Request) -> type[Input] | None:
    """The input a request to a token-guarded route becomes (None: /health, never guarded),
    known from its method and query alone, before its body is read."""
    path = request.url.path
    if path == "/route":
        if request.method == "PUT":
            return RegisterRank
        values = [request.query_params.get(name) for name in ROUTE_QUERY]
        return QueryTopology if values == ["-1"] * len(ROUTE_QUERY) else QueryRank
    return _GUARDED_BODY_ROUTES.get(path)


_GUARDED_BODY_ROUTES: dict[str, type[Input]] = {
    "/register_dp_rank": RegisterDpRank, "/query_dp_ranks": QueryDpRanks,
}


def rank_query_of(request: Request) -> Input:
    values = [request.query_params.get(name, "") for name in ROUTE_QUERY]
    if any(not value for value in values):
        raise _Refusal(400, MISSING_INPUTS)
    ranks: list[int] = []
    for name, value in zip(ROUTE_QUERY, values, strict=True):
        try:
            ranks.append(int(value))
        except ValueError:
            raise _Refusal(400, f"Invalid inputs for bootstrap server: {name}={value!r} is not "
                                "an integer.") from None
    dp, cp, tp, pp = ranks
    return route_query(dp, cp, tp, pp, request_token(request))


async def dp_rank_registration_of(request: Request, limit: int) -> RegisterDpRank:
    body: _DpRankBody = _convert(await _json_object(request, limit), _DpRankBody,
                                 "dp rank registration")
    return RegisterDpRank(body.bootstrap_room, body.dp_rank, request_token(request))


async def dp_rank_query_of(request: Request, limit: int) -> QueryDpRanks:
    body: _DpQueryBody = _convert(await _json_object(request, limit), _DpQueryBody,
                                  "dp rank query")
    return QueryDpRanks(tuple(body.bootstrap_rooms), request_token(request))


# ---- reply -> response ------------------------------------------------------------------------
def response_of(reply: Reply) -> Response:
    if isinstance(reply.body, str):
        return PlainTextResponse(reply.body, status_code=reply.status)
    return Response(msgspec.json.encode(reply.body), status_code=reply.status,
                    media_type="application/json")


# ---- the app --------------------------------------------------------------------------------
def build_app(
    registry: Registry,
    *,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    max_body: int = DEFAULT_MAX_BODY,
    incarnation: str | None = None,
    wedged: Wedged = healthy,
) -> ASGIApp:
    """The ASGI app serving ``registry``. Every request is answered by the registry.

    ``clock`` is the registry's ``now`` (room expiry: monotonic); ``wall_clock`` stamps each
    registration's arrival, which its ``started_at`` (the prefill's wall clock) is checked
    against. ``wedged``: a hosting prefill's ranks that stopped turning (its ``/health`` then
    answers 503, :class:`pdflow.io.health_server.WedgeAnswer`)."""
    if max_body < 1:
        raise ValueError(f"max_body must be at least 1 byte, got {max_body}")

    def answering(
        parse: Callable[[Request], Awaitable[Input]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            kind = guarded_kind(request)
            if kind is not None and not registry.accepts_token(request_token(request)):
                return response_of(unauthorized_reply(kind))  # before anything is read
            try:
                inp = await parse(request)
                reply = registry.reply_to(inp, clock())
            except _Refusal as refusal:
                return PlainTextResponse(refusal.text, status_code=refusal.status)
            except RequestTimeout as timeout:
                log.info("bootstrap_request_timeout", path=request.url.path)
                return PlainTextResponse(str(timeout), status_code=TIMEOUT_STATUS,
                                         headers=TIMEOUT_HEADERS)
            except ClientDisconnect:  # the client went away mid-request: nothing to answer
                log.info("bootstrap_client_disconnected", path=request.url.path)
                return PlainTextResponse("Client closed the request", status_code=499)
            except Exception as exc:  # a bug: answer it here, so uvicorn keeps the connection
                _log_failure(registry, request.url.path, exc)
                return PlainTextResponse("Internal error in the bootstrap server; see its log",
                                         status_code=500)
            if reply.status == 409:
                log.warning("registration_superseded", detail=str(reply.body)[:300])
            return response_of(reply)

        return endpoint

    async def parse_route(request: Request) -> Input:
        if request.method == "PUT":
            return await registration_of(request, max_body, wall_clock)
        return rank_query_of(request)

    async def parse_dp_registration(request: Request) -> Input:
        return await dp_rank_registration_of(request, max_body)

    async def parse_dp_query(request: Request) -> Input:
        return await dp_rank_query_of(request, max_body)

    async def parse_health(request: Request) -> Input:
        return CheckHealth()

    wedge = WedgeAnswer(None, wedged)  # _RequestLog adds the incarnation to every answer
    registry_health = answering(parse_health)

    async def health(request: Request) -> Response:
        return wedge.now() or await registry_health(request)

    async def not_found(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("404: Not Found", status_code=404)

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("Method not allowed", status_code=405)

    app = Starlette(
        routes=[
            Route("/route", answering(parse_route), methods=["GET", "PUT"]),
            Route("/register_dp_rank", answering(parse_dp_registration), methods=["POST"]),
            Route("/query_dp_ranks", answering(parse_dp_query), methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: not_allowed},
    )
    return _RequestLog(app, incarnation)


def _log_failure(registry: Registry, path: str, exc: Exception) -> None:
    """Log a handler failure with its traceback, formatted here: a renderer the embedding
    process configured (structlog's dev renderer shows rich tracebacks with every frame's
    local variables) would print requests and tokens held in locals."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    log.error("bootstrap_handler_failed", path=path,
              error=registry.redacted(f"{type(exc).__name__}: {exc}"),
              traceback=registry.redacted(text))


class _RequestLog:
    """One structured log line per request, and the incarnation header on every response."""

    def __init__(self, app: ASGIApp, incarnation: str | None) -> None:
        self.app = app
        self.extra_headers = (
            [(INCARNATION_HEADER.lower().encode(), incarnation.encode())] if incarnation else []
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  *self.extra_headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            client = scope.get("client")
            log.info(
                "bootstrap_request",
                method=scope["method"],
                path=scope["path"],
                status=status,
                ms=round((time.perf_counter() - started) * 1000, 3),
                peer=f"{client[0]}:{client[1]}" if client else None,
            )


# ---- running it -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunningBootstrap:
    """A bound, serving bootstrap server (as yielded by :func:`serve`)."""

    host: str
    port: int
    registry: Registry
    incarnation: str | None

    @property
    def address(self) -> str:
        """``host:port``, the form SGLang calls a bootstrap address."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@asynccontextmanager
async def serve(
    host: str = "127.0.0.1",
    port: int = 8998,
    *,
    token: str | None = None,
    incarnation: str | None = None,
    dp_rank_ttl: float = DEFAULT_DP_RANK_TTL_S,
    max_body: int = DEFAULT_MAX_BODY,
    tick_interval: float = DEFAULT_TICK_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    sock: socket.socket | None = None,
    registry: Registry | None = None,
    limits: ServingLimits = ServingLimits(),  # noqa: B008 - immutable
    wedged: Wedged = healthy,
) -> AsyncIterator[RunningBootstrap]:
    """Serve the bootstrap registry until the ``async with`` block ends.

    ``sock`` is an already bound socket to serve on instead of binding ``host:port`` (it is
    closed on exit). Leaving the block stops accepting, finishes the requests in flight and
    closes the socket; no task is left behind. ``limits``: what a client may hold (connections,
    time to send a request). ``wedged``: as for :func:`build_app`.
    """
    require_asyncio("bootstrap server")
    if tick_interval <= 0:
        raise ValueError(f"tick_interval must be positive seconds, got {tick_interval}")
    registry = registry if registry is not None else Registry(token=token,
                                                              dp_rank_ttl=dp_rank_ttl)
    app = build_app(registry, clock=clock, wall_clock=wall_clock, max_body=max_body,
                    incarnation=incarnation, wedged=wedged)
    listener = sock if sock is not None else bind(host, port)
    bound_host, bound_port = listener.getsockname()[:2]

    async def tick_forever() -> None:
        while True:
            await anyio.sleep(tick_interval)
            registry.handle(Tick(), clock())

    async with (
        serving(app, listener, "bootstrap server", limits),
        anyio.create_task_group() as ticks,
    ):
        ticks.start_soon(tick_forever)
        log.info("bootstrap_listening", host=bound_host, port=bound_port,
                 token_required=registry.requires_token, incarnation=incarnation)
        try:
            yield RunningBootstrap(bound_host, bound_port, registry, incarnation)
        finally:
            ticks.cancel_scope.cancel()
