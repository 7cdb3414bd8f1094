"""``GET /metrics``: a node's Prometheus text over HTTP, served from the node's own event loop.

Deliberately small: one request per connection (``Connection: close``), the request head read
within a deadline and a size bound; anything but ``GET /metrics`` (or ``HEAD``) gets a
plain-text error naming what to ask for. With the cluster token set, a scrape must carry it
(``Authorization: Bearer <token>`` or ``X-Pdflow-Token``), as the registry's reads do: the
labels name peers.

Connections that have not sent their request head yet are at most ``MAX_READING``: one more
closes the longest waiting (a scraper sends its request as it connects, so only silent ones
wait), and each has ``HEAD_DEADLINE_S``. Only a request that passed the token check takes one
of the ``MAX_CONNECTIONS`` slots that build the text (on the node's loop): idle or tokenless
connections can no longer hold every slot and turn the scraper away.
"""

from __future__ import annotations

import contextlib
import hmac
from collections import OrderedDict
from collections.abc import Callable

import anyio
import structlog
from anyio.abc import Listener, SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

log = structlog.get_logger("pdflow.metrics")

MAX_REQUEST_HEAD = 8192
HEAD_DEADLINE_S = 2.0
MAX_READING = 64
MAX_CONNECTIONS = 8
# What generate_latest() writes: the classic Prometheus text format.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """Answers scrapes with ``text()``; :meth:`serve` runs until cancelled."""

    def __init__(self, text: Callable[[], str], token: str | None) -> None:
        self._text = text
        self._token = token
        self._limiter = anyio.CapacityLimiter(MAX_CONNECTIONS)
        # Connections still reading their request head, the longest waiting first.
        self._reading: OrderedDict[int, anyio.CancelScope] = OrderedDict()

    async def handle(self, stream: SocketStream) -> None:
        async with stream:
            head = await self._read_head(stream)
            if head is not None:
                await self._serve_one(stream, head)

    async def _read_head(self, stream: SocketStream) -> bytes | None:
        """The request head, or None (answered already, or the client went or was cut)."""
        if len(self._reading) >= MAX_READING:
            _, longest = self._reading.popitem(last=False)
            longest.cancel()
        scope = anyio.CancelScope(deadline=anyio.current_time() + HEAD_DEADLINE_S)
        self._reading[id(scope)] = scope
        reader = BufferedByteReceiveStream(stream)
        try:
            with scope:
                head = await reader.receive_until(b"\r\n\r\n", MAX_REQUEST_HEAD)
                if len(head) <= MAX_REQUEST_HEAD:
                    return head
                # receive_until bounds what it buffers without the delimiter, not the head.
            if scope.cancel_called:
                return None
        except anyio.DelimiterNotFound:
            pass
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            return None
        finally:
            self._reading.pop(id(scope), None)
        await _answer(stream, 431, f"request head larger than {MAX_REQUEST_HEAD} bytes")
        return None

    async def _serve_one(self, stream: SocketStream, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            await _answer(stream, 400, "malformed request line; send GET /metrics HTTP/1.1")
            return
        method, target, _version = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if target.split("?", 1)[0] != "/metrics":
            await _answer(stream, 404, "not found; metrics are at /metrics")
        elif method not in ("GET", "HEAD"):
            await _answer(stream, 405, "only GET /metrics is served")
        elif not self._authorized(headers):
            await _answer(stream, 401, "this cluster needs its token: Authorization: Bearer ...")
        elif self._limiter.available_tokens == 0:
            await _answer(stream, 503, "too many scrapes at once; retry")
        else:
            async with self._limiter:
                await _answer(stream, 200, self._text(), TEXT_FORMAT, body=method == "GET")

    def _authorized(self, headers: dict[str, str]) -> bool:
        if self._token is None:
            return True
        given = headers.get("x-pdflow-token") or None  # an empty header is no token
        bearer = headers.get("authorization", "")
        if given is None and bearer.lower().startswith("bearer "):
            given = bearer[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), self._token.encode())


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}  # fmt: skip


async def _answer(
    stream: SocketStream,
    status: int,
    text: str,
    content_type: str = "text/plain; charset=utf-8",
    *,
    body: bool = True,
) -> None:
    payload = text.encode() if text.endswith("\n") else (text + "\n").encode()
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await stream.send(head.encode() + (payload if body else b""))


async def open_metrics_listener(host: str, port: int) -> tuple[Listener[SocketStream], str]:
    """Bind ``host:port`` (0: a free port); returns the listener and its ``host:port``."""
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot serve /metrics on {host}:{port}: {exc.strerror}; "
            "pick another metrics_port (0: any free port)",
        ) from exc
    bound = listener.extra(SocketAttribute.local_port)
    return listener, f"{host}:{bound}"
