"""The bootstrap server (and the health endpoint) against hostile requests over real HTTP:
nesting, media types, the keep-alive connection surviving every refusal, silent and slow
connections, the token checked first, and what failures log."""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator

import anyio
import httpx
import pytest
import structlog
import structlog.testing
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from pdflow.cli import bootstrap_cmd
from pdflow.core.cluster.registry import (
    STARTED_AT_TOLERANCE_S,
    CheckHealth,
    RegisterRank,
    Registry,
    Reply,
)
from pdflow.core.protocol.inputs import Input
from pdflow.io.asgi_serving import ServingLimits
from pdflow.io.bootstrap_server import serve
from pdflow.io.health_server import serve_health
from pdflow.io.json_guard import MAX_JSON_DEPTH

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

BODY_ROUTES = [("PUT", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks")]
TOKEN = "hostile-test-token-5f2c"
REGISTRATION = {
    "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
    "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
    "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 40001, "page_size": 1,
    "kv_cache_dtype": "auto",
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RawHttp:
    """HTTP/1.1 on one TCP connection, so a test sees whether the server kept it open."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.extra_headers: list[str] = []

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str | None = "application/json") -> tuple[int, dict[str, str],
                                                                               bytes]:  # fmt: skip
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
        if content_type is not None:
            head.append(f"Content-Type: {content_type}")
        head.extend(self.extra_headers)
        await self.stream.send(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        with anyio.fail_after(10):
            status_line = await self.reader.receive_until(b"\r\n", 1 << 16)
            headers: dict[str, str] = {}
            while line := await self.reader.receive_until(b"\r\n", 1 << 16):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            payload = await self.reader.receive_exactly(int(headers.get("content-length", 0)))
        return int(status_line.split()[1]), headers, payload


async def test_deeply_nested_json_gets_400_on_every_route_and_keeps_the_connection() -> None:
    """Before: msgspec's RecursionError escaped (500) and uvicorn closed the connection."""
    deep = b"[" * 20_000 + b"]" * 20_000
    just_too_deep = b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    async with serve("127.0.0.1", 0) as server:
        stream = await anyio.connect_tcp("127.0.0.1", server.port)
        async with stream:
            http = RawHttp(stream)
            for method, path in BODY_ROUTES:
                for body in (deep, just_too_deep):
                    status, headers, text = await http.request(method, path, body)
                    assert status == 400, (path, text)
                    assert b"nested deeper than" in text
                    assert headers.get("connection") != "close"
            status, _, text = await http.request("GET", "/health", content_type=None)
            assert (status, text) == (200, b"OK")


async def test_a_body_that_is_not_declared_json_gets_415_on_every_route() -> None:
    body = b'{"bootstrap_room": 1, "dp_rank": 0}'
    async with serve("127.0.0.1", 0) as server:
        stream = await anyio.connect_tcp("127.0.0.1", server.port)
        async with stream:
            http = RawHttp(stream)
            for method, path in BODY_ROUTES:
                for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
                    status, _, text = await http.request(method, path, body, content_type)
                    assert status == 415, (path, content_type, text)
                    assert b"Content-Type: application/json" in text
            # What SGLang's clients send (requests / aiohttp json=) still works.
            for content_type in ("application/json", "application/json; charset=utf-8"):
                status, _, text = await http.request("POST", "/register_dp_rank", body,
                                                     content_type)  # fmt: skip
                assert (status, text) == (200, b"OK")
            status, _, text = await http.request(
                "POST", "/query_dp_ranks", b'{"bootstrap_rooms": [1, 2]}')
            assert (status, text) == (200, b'{"1":0}')


class _BrokenRegistry(Registry):
    """A registry with a bug: answering a health check raises."""

    def reply_to(self, inp: Input, now: float) -> Reply:
        if isinstance(inp, CheckHealth):
            raise KeyError("a registry bug")
        return super().reply_to(inp, now)


async def test_a_failing_handler_gets_a_500_and_the_connection_stays_open() -> None:
    async with serve("127.0.0.1", 0, registry=_BrokenRegistry()) as server:
        stream = await anyio.connect_tcp("127.0.0.1", server.port)
        async with stream:
            http = RawHttp(stream)
            status, headers, text = await http.request("GET", "/health", content_type=None)
            assert (status, text) == (500, b"Internal error in the bootstrap server; see its log")
            assert headers.get("connection") != "close"
            status, _, _ = await http.request("GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                              "&target_tp_rank=-1&target_pp_rank=-1")  # fmt: skip
            assert status == 503


# ---- connections that hold the server without sending a request -------------------------------
FAST_LIMITS = ServingLimits(max_connections=64, header_timeout_s=0.5, body_timeout_s=0.5)


async def _closed_by_server(stream: SocketStream, within: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open."""
    received = b""
    with anyio.move_on_after(within):
        try:
            while True:
                received += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return received
    return None


async def test_silent_and_slow_clients_are_cut_after_the_deadline_and_others_are_served() -> None:
    """Before: uvicorn held a connection that never completed a request for ever (its
    keep-alive timer only runs between requests), so 2,000 of them exhausted the server's file
    descriptors. Now headers are due within header_timeout_s (in total, however slowly they
    drip), a body within body_timeout_s (then 408, and the connection is closed)."""
    async with serve("127.0.0.1", 0, limits=FAST_LIMITS) as server:
        connect = functools.partial(anyio.connect_tcp, "127.0.0.1", server.port)
        idle, partial_head, dripping, partial_body = [await connect() for _ in range(4)]
        await partial_head.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        await partial_body.send(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                b"application/json\r\nContent-Length: 1000\r\n\r\n{")
        served = await connect()
        http = RawHttp(served)

        async def drip() -> None:
            try:
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n":
                    await dripping.send(bytes([byte]))
                    await anyio.sleep(0.1)  # each byte well within the deadline, not all
            except (anyio.BrokenResourceError, ConnectionError):
                pass  # cut by the server

        outcome: dict[str, bytes | None] = {}

        async def watch(name: str, stream: SocketStream) -> None:
            outcome[name] = await _closed_by_server(stream, 3.0)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(drip)
            for name, stream in (("idle", idle), ("partial_head", partial_head),
                                 ("dripping", dripping), ("partial_body", partial_body)):
                tasks.start_soon(watch, name, stream)
            for _ in range(5):  # meanwhile a well-behaved client is served, on one connection
                assert (await http.request("GET", "/health", content_type=None))[0] == 200
                await anyio.sleep(0.1)
            started = anyio.current_time()
        assert anyio.current_time() - started < 1.5, "cut by the deadline, not by the watch"
        assert outcome["idle"] == b"" and outcome["partial_head"] == b""
        assert outcome["dripping"] == b"", "the header deadline is a total, not per byte"
        body = outcome["partial_body"]
        assert body is not None and body.startswith(b"HTTP/1.1 408 ")
        assert b"did not arrive within 0.5 s" in body and b"connection: close" in body.lower()
        status, _, text = await http.request("GET", "/health", content_type=None)
        assert (status, text) == (200, b"OK")
        for stream in (idle, partial_head, dripping, partial_body, served):
            await stream.aclose()


async def test_a_flood_of_silent_connections_holds_no_more_than_the_cap() -> None:
    """Each connection is a file descriptor: the server holds at most max_connections. One past
    it evicts the oldest that has not sent its headers, so a client that sends its request is
    served at once even while silent connections keep coming (before: every one was held)."""
    limits = ServingLimits(max_connections=8, header_timeout_s=5.0, body_timeout_s=5.0)
    async with serve("127.0.0.1", 0, limits=limits) as server:
        served = await anyio.connect_tcp("127.0.0.1", server.port)
        http = RawHttp(served)
        assert (await http.request("GET", "/health", content_type=None))[0] == 200
        silent = [await anyio.connect_tcp("127.0.0.1", server.port) for _ in range(30)]
        await anyio.sleep(0.3)  # well before the header deadline
        dropped = [await _closed_by_server(stream, 0.01) for stream in silent]
        assert sum(d == b"" for d in dropped) >= 30 - (limits.max_connections - 1), dropped
        assert dropped[-1] is None, "the newest are kept, the oldest evicted"
        assert (await http.request("GET", "/health", content_type=None))[0] == 200
        with anyio.fail_after(1):  # long before the silent ones time out
            async with await anyio.connect_tcp("127.0.0.1", server.port) as late:
                status, _, _ = await RawHttp(late).request("GET", "/health", content_type=None)
        assert status == 200
        for stream in (*silent, served):
            await stream.aclose()


async def test_clients_kept_alive_up_to_the_cap_do_not_turn_a_new_client_away() -> None:
    """Every decode rank heartbeats a registry that serves a prefill's /health and keeps its
    connection alive between probes: with the cap reached by such clients alone, the next
    client is served and the longest idle connection closed (it reconnects for its next)."""
    limits = ServingLimits(max_connections=4, header_timeout_s=5.0, body_timeout_s=5.0)
    async with serve("127.0.0.1", 0, limits=limits) as server:
        kept = [await anyio.connect_tcp("127.0.0.1", server.port) for _ in range(4)]
        for stream in kept:
            assert (await RawHttp(stream).request("GET", "/health", content_type=None))[0] == 200
        with anyio.fail_after(2):
            async with await anyio.connect_tcp("127.0.0.1", server.port) as newcomer:
                status, _, _ = await RawHttp(newcomer).request("GET", "/health",
                                                               content_type=None)  # fmt: skip
        assert status == 200
        assert await _closed_by_server(kept[0], 1.0) == b"", "the longest idle one was closed"
        assert (await RawHttp(kept[-1]).request("GET", "/health", content_type=None))[0] == 200
        for stream in kept:
            await stream.aclose()


def test_serving_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        ServingLimits(max_connections=1)
    with pytest.raises(ValueError, match="positive"):
        ServingLimits(header_timeout_s=0)


# ---- the token before anything else ----------------------------------------------------------
async def test_without_the_token_nothing_of_the_request_is_read() -> None:
    """Before: a tokenless PUT got 400 naming the schema's fields, 415 or 413 first; now the
    token is checked before the body is read."""
    async with serve("127.0.0.1", 0, token=TOKEN, max_body=64) as server:
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            http = RawHttp(stream)
            for method, path in BODY_ROUTES:
                for body, content_type in ((b"{}", "application/json"), (b"x", "text/plain"),
                                           (b"[" * 10_000, "application/json")):
                    status, headers, text = await http.request(method, path, body, content_type)
                    assert status == 401, (path, body[:5], text)
                    assert b"PDFLOW_BOOTSTRAP_TOKEN" in text and b"attn_tp_size" not in text
                    assert headers.get("connection") != "close"
            for query in ("", "?prefill_dp_rank=x"):
                status, _, text = await http.request("GET", "/route" + query, content_type=None)
                assert status == 401 and b"rank read" in text
        assert server.registry.snapshot().first is None


# ---- what a failure or a disconnect logs -----------------------------------------------------
class _LeakyRegistry(Registry):
    """A registry with a bug whose exception names the request (token and all) and whose frame
    holds the token in a local variable, as a careless traceback would show it."""

    def reply_to(self, inp: Input, now: float) -> Reply:
        if isinstance(inp, RegisterRank):
            presented = inp.token  # noqa: F841 - a local a traceback with locals would print
            raise RuntimeError(f"a registry bug handling {inp!r} (token {inp.token})")
        return super().reply_to(inp, now)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


async def _fail_a_registration(log_to: io.StringIO) -> None:
    registry = _LeakyRegistry(token=TOKEN)
    async with (
        serve("127.0.0.1", 0, token=TOKEN, registry=registry) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        http = RawHttp(stream)
        http.extra_headers = [f"Authorization: Bearer {TOKEN}"]
        body = json.dumps(REGISTRATION).encode()
        status, headers, _ = await http.request("PUT", "/route", body)
        assert status == 500 and headers.get("connection") != "close"
    assert "bootstrap_handler_failed" in log_to.getvalue()


@pytest.mark.usefixtures("restore_logging")
async def test_a_handler_failure_never_logs_the_token_whatever_the_renderer() -> None:
    """structlog's default (dev) renderer prints rich tracebacks with every frame's locals: the
    request, its input and its token. The failure is logged with a plain traceback instead, the
    token blanked out (and never in an input's repr)."""
    out = io.StringIO()
    structlog.reset_defaults()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
    await _fail_a_registration(out)
    text = out.getvalue()
    assert TOKEN not in text, text
    assert "Traceback (most recent call last)" in text and "a registry bug handling" in text


@pytest.mark.usefixtures("restore_logging")
async def test_pdflow_bootstrap_logs_a_handler_failure_with_its_traceback() -> None:
    """Before: `pdflow bootstrap` logged bootstrap_handler_failed as "exc_info": true, no
    traceback (its JSON logging had no exception formatter)."""
    out = io.StringIO()
    bootstrap_cmd._log_json_to(out)
    await _fail_a_registration(out)
    (failure,) = [json.loads(line) for line in out.getvalue().splitlines()
                  if "bootstrap_handler_failed" in line]
    assert failure["level"] == "error" and failure["path"] == "/route"
    assert "Traceback (most recent call last)" in failure["traceback"]
    assert "RuntimeError: a registry bug handling" in failure["traceback"]
    assert TOKEN not in out.getvalue()
    out.seek(0)
    out.truncate()
    try:
        raise KeyError("elsewhere")
    except KeyError:
        structlog.get_logger("pdflow.test").exception("some_failure")
    assert "Traceback (most recent call last)" in json.loads(out.getvalue())["exception"]


async def test_a_client_disconnecting_mid_body_is_not_logged_as_a_bug() -> None:
    """Before: Starlette's ClientDisconnect was logged as bootstrap_handler_failed (a 500)."""
    with structlog.testing.capture_logs() as logs:
        async with serve("127.0.0.1", 0) as server:
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                await stream.send(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                  b"application/json\r\nContent-Length: 1000\r\n\r\n{")
                await anyio.sleep(0.1)
            with anyio.fail_after(5):
                while not any(e["event"] == "bootstrap_request" for e in logs):
                    await anyio.sleep(0.01)
    events = [e["event"] for e in logs]
    assert "bootstrap_handler_failed" not in events
    assert "bootstrap_client_disconnected" in events


# ---- the started_at checked against the server's clock ---------------------------------------
async def test_a_start_time_ahead_of_the_servers_clock_is_refused() -> None:
    async with (
        serve("127.0.0.1", 0, wall_clock=lambda: 1000.0) as server,
        await anyio.connect_tcp("127.0.0.1", server.port) as stream,
    ):
        http = RawHttp(stream)

        async def put(**fields: object) -> tuple[int, bytes]:
            body = json.dumps({**REGISTRATION, "incarnation": "p", **fields}).encode()
            status, _, text = await http.request("PUT", "/route", body)
            return status, text

        # A body cannot claim the arrival time: the server stamps its own clock.
        status, text = await put(started_at=1e300, received_at=1e301)
        assert status == 400 and b"a process cannot start in the future" in text
        assert (await put(started_at=1000.0 + STARTED_AT_TOLERANCE_S)) == (200, b"OK")


# ---- the health endpoint ---------------------------------------------------------------------
async def test_health_endpoint_answers_404_and_405_as_the_registry_does() -> None:
    """Before: a wrong method on the health endpoint got 404."""
    async with (
        serve_health("127.0.0.1", "inc-7") as address,
        httpx.AsyncClient(base_url=f"http://{address}") as client,
    ):
        ok = await client.get("/health")
        assert (ok.status_code, ok.text, ok.headers["x-pdflow-incarnation"]) == (
            200, "OK", "inc-7")
        wrong = await client.post("/health")
        assert (wrong.status_code, wrong.text) == (405, "Method not allowed")
        assert (await client.get("/nope")).status_code == 404


async def test_health_endpoint_cuts_silent_connections() -> None:
    async with serve_health("127.0.0.1", "inc-7", limits=FAST_LIMITS) as address:
        host, _, port = address.rpartition(":")
        async with await anyio.connect_tcp(host, int(port)) as silent:
            assert await _closed_by_server(silent, 3.0) == b""
