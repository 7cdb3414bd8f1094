"""The bootstrap server against hostile requests over real HTTP: nesting, media types, and the
keep-alive connection surviving every refusal."""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from pdflow.core.cluster.registry import CheckHealth, Registry, Reply
from pdflow.core.protocol.inputs import Input
from pdflow.io.bootstrap_server import serve
from pdflow.io.json_guard import MAX_JSON_DEPTH

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

BODY_ROUTES = [("PUT", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RawHttp:
    """HTTP/1.1 on one TCP connection, so a test sees whether the server kept it open."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str | None = "application/json") -> tuple[int, dict[str, str],
                                                                               bytes]:  # fmt: skip
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
        if content_type is not None:
            head.append(f"Content-Type: {content_type}")
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
