"""The heartbeat's ``/health`` probe against servers that close idle keep-alive connections.

A server closes an idle keep-alive connection when its own timer says so; a client that picks
the same connection from its pool at that moment sends its request into a socket the server is
closing and gets no answer (a reset: ``ReadError``; a clean close: ``RemoteProtocolError``). In
CI this failed one probe of a live prefill. The probe must tell that apart from a dead or
paused server, and must not take longer to notice one. A server that drips its answer a byte
at a time (each within the read timeout) must not hold a probe, nor the heartbeat's other
targets, past the probe's budget.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import anyio
import pytest
import structlog.testing

from pdflow.core.endpoints.endpoint_io import HeartbeatResult
from pdflow.core.endpoints.liveness import ProbeTarget
from pdflow.io.bootstrap_client import BootstrapClient, BootstrapUnavailable, HealthStatus
from pdflow.io.heartbeat import FailureLog, probe_once

pytestmark = pytest.mark.integration


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the scripted server is asyncio's; the nodes run on asyncio too

_OK = (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-pdflow-incarnation: inc-1\r\n"
       b"connection: keep-alive\r\n\r\nOK")  # fmt: skip


@dataclass
class Server:
    """A raw HTTP/1.1 server whose behaviour per request is scripted: ``answer`` (200 OK and
    keep the connection), ``close`` (read the request, close cleanly, no answer), ``reset``
    (read it, close with a TCP reset), ``late-reset`` (reset it ``late_s`` after reading),
    ``hang`` (read it, never answer) or ``drip`` (answer headers, then one body byte every
    ``late_s``, never finishing)."""

    script: list[str]
    address: str = ""
    requests: int = 0
    connections: int = 0
    late_s: float = 0.0
    _open: list[asyncio.StreamWriter] = field(default_factory=list)

    def next_action(self) -> str:
        self.requests += 1
        return self.script[min(self.requests, len(self.script)) - 1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open.append(writer)
        while await reader.readuntil(b"\r\n\r\n"):
            action = self.next_action()
            if action == "answer":
                writer.write(_OK)
                await writer.drain()
                continue
            if action == "hang":
                return
            if action == "drip":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n"
                             b"x-pdflow-incarnation: inc-1\r\n\r\n")
                while True:
                    await writer.drain()
                    await asyncio.sleep(self.late_s)
                    writer.write(b"O")
            if action == "late-reset":
                await asyncio.sleep(self.late_s)
            if action in ("reset", "late-reset"):
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            return


@asynccontextmanager
async def scripted(*script: str, late_s: float = 0.0) -> AsyncIterator[Server]:
    server = Server(list(script), late_s=late_s)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(asyncio.IncompleteReadError, ConnectionError):
            await server.handle(reader, writer)

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    host, port = listener.sockets[0].getsockname()[:2]
    server.address = f"{host}:{port}"
    async with listener:
        yield server
        for writer in server._open:  # the server is gone: so are its connections
            writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("drop", ["close", "reset"])
async def test_a_live_server_closing_the_pooled_connection_is_healthy(drop: str) -> None:
    """Red before the fix: the second probe reused the first probe's connection, the server
    dropped it, and the live server was reported unhealthy."""
    async with scripted("answer", drop, "answer") as server:
        client = BootstrapClient(server.address, rng=random.Random(0))
        first = await client.health()
        second = await client.health()
        await client.aclose()
    assert (first.ok, first.incarnation) == (True, "inc-1")
    assert (second.ok, second.incarnation, second.detail) == (True, "inc-1", "")
    # The retry went out on a new connection, not on another pooled one.
    assert (server.requests, server.connections) == (3, 2)


@pytest.mark.anyio
@pytest.mark.parametrize("drop", ["close", "reset"])
async def test_a_server_that_drops_every_request_is_unhealthy_after_one_retry(drop: str) -> None:
    async with scripted("answer", drop) as server:
        client = BootstrapClient(server.address, rng=random.Random(0))
        assert (await client.health()).ok
        down = await client.health()
        await client.aclose()
    assert not down.ok and down.incarnation is None and down.detail
    assert server.requests == 3, "one probe, then exactly one retry"


@pytest.mark.anyio
async def test_a_paused_server_fails_the_probe_by_its_deadline_without_a_retry() -> None:
    """A read timeout is a paused or overloaded server, not a stale connection: retrying it
    would double the time the heartbeat takes to notice."""
    async with scripted("answer", "hang") as server:
        client = BootstrapClient(server.address, rng=random.Random(0), health_read_s=0.2)
        assert (await client.health()).ok
        down = await client.health()
        await client.aclose()
    assert not down.ok and "ReadTimeout" in down.detail
    assert (server.requests, server.connections) == (2, 1)


@pytest.mark.anyio
async def test_the_retry_only_gets_what_is_left_of_the_probes_time() -> None:
    """A request reset just before its read timeout, then a retry that hangs: the probe still
    fails within one probe's time (connect + read timeouts, 0.6 s here), not 0.45 + 0.5 s.
    Red with the retry given its own full timeouts."""
    async with scripted("answer", "late-reset", "hang", late_s=0.45) as server:
        client = BootstrapClient(server.address, rng=random.Random(0),
                                 health_connect_s=0.1, health_read_s=0.5)  # fmt: skip
        assert (await client.health()).ok
        started = time.monotonic()
        down = await client.health()
        took = time.monotonic() - started
        await client.aclose()
    assert not down.ok and down.incarnation is None and "retry" in down.detail
    assert server.requests == 3, "the retry went out"
    assert 0.45 <= took < 0.75, took


@pytest.mark.anyio
async def test_a_dead_server_fails_the_probe() -> None:
    async with scripted("answer") as server:
        address = server.address
        client = BootstrapClient(address, rng=random.Random(0))
        assert (await client.health()).ok
    down = await client.health()
    await client.aclose()
    assert not down.ok and down.incarnation is None and down.detail


@pytest.mark.anyio
async def test_a_dripping_server_fails_the_probe_within_its_budget() -> None:
    """Before: httpx's timeouts are per read, so a byte every 0.2 s (read timeout 0.3 s) held
    the probe for as long as the server liked; it now fails at connect + read budget."""
    async with scripted("drip", late_s=0.2) as server:
        client = BootstrapClient(server.address, rng=random.Random(0),
                                 health_connect_s=0.2, health_read_s=0.3)  # fmt: skip
        started = time.monotonic()
        with anyio.fail_after(3):
            down = await client.health()
        took = time.monotonic() - started
        await client.aclose()
    assert not down.ok and "within 0.5s" in down.detail, down
    assert took < 0.9, took


@pytest.mark.anyio
async def test_a_dripping_target_does_not_hold_back_the_others() -> None:
    async with scripted("drip", late_s=0.2) as dripping, scripted("answer") as live:
        clients = {address: BootstrapClient(address, rng=random.Random(0), health_connect_s=0.2,
                                            health_read_s=0.3)
                   for address in (dripping.address, live.address)}  # fmt: skip
        delivered: list[tuple[float, HeartbeatResult]] = []

        async def probe(target: ProbeTarget) -> HealthStatus:
            return await clients[target.bootstrap].health()

        async def deliver(result: HeartbeatResult) -> None:
            delivered.append((time.monotonic(), result))

        started = time.monotonic()
        with anyio.fail_after(5):
            await probe_once([ProbeTarget(dripping.address, None),
                              ProbeTarget(live.address, None)], probe, deliver)
        for client in clients.values():
            await client.aclose()
    by_target = {result.bootstrap: (at - started, result) for at, result in delivered}
    assert by_target[live.address][1].ok and by_target[live.address][0] < 0.3
    assert not by_target[dripping.address][1].ok and by_target[dripping.address][0] < 0.9


@pytest.mark.anyio
async def test_a_probe_that_never_returns_is_reported_down_at_the_heartbeats_deadline() -> None:
    delivered: list[HeartbeatResult] = []

    async def stuck(target: ProbeTarget) -> HealthStatus:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def deliver(result: HeartbeatResult) -> None:
        delivered.append(result)

    with anyio.fail_after(2):
        await probe_once([ProbeTarget("10.0.0.1:8998", "10.0.0.1:9000")], stuck, deliver,
                         deadline_s=0.2)  # fmt: skip
    (result,) = delivered
    assert not result.ok and result.health == "10.0.0.1:9000"


@pytest.mark.anyio
async def test_a_dripping_bootstrap_request_fails_within_the_clients_timeout() -> None:
    """Registry requests have the same total deadline (``timeout_s``)."""
    async with scripted("drip", late_s=0.2) as server:
        client = BootstrapClient(server.address, rng=random.Random(0), timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(BootstrapUnavailable, match="no complete answer"), anyio.fail_after(3):
            await client.query_dp_ranks([1])
        took = time.monotonic() - started
        await client.aclose()
    assert took < 0.9, took


@pytest.mark.anyio
async def test_a_200_without_incarnation_fails_a_prefills_own_probe_not_the_registrys() -> None:
    """A prefill's own health endpoint always names its incarnation: an answer without one
    came from another server and fails the probe. SGLang's registry ``/health`` (the target of
    ranks that registered no health address) never names one and stays healthy."""
    delivered: dict[str | None, HeartbeatResult] = {}

    async def anonymous_200(target: ProbeTarget) -> HealthStatus:
        return HealthStatus(True, None)

    async def deliver(result: HeartbeatResult) -> None:
        delivered[result.health] = result

    targets = [ProbeTarget("10.0.0.1:8998", "10.0.0.1:9000"), ProbeTarget("10.0.0.2:8998")]
    await probe_once(targets, anonymous_200, deliver)
    assert not delivered["10.0.0.1:9000"].ok
    assert delivered[None].ok


def test_a_target_failing_probe_after_probe_is_logged_once_a_minute_with_a_count() -> None:
    """A lost prefill is probed every interval: its failures are logged at the first, then once
    per REPEAT_LOG_S with how many went unlogged; an answer ends the streak."""
    now = [0.0]
    failures = FailureLog(every_s=60.0, clock=lambda: now[0])
    target = ProbeTarget("10.0.0.1:8998", "10.0.0.1:9000")
    with structlog.testing.capture_logs() as logged:
        for second in range(0, 125, 5):
            now[0] = float(second)
            failures.failed(target, "ConnectError")
        failures.answered(target)
        failures.failed(target, "ConnectError")
    assert [(e["event"], e["unlogged_since"]) for e in logged] == [
        ("heartbeat_failed", 0), ("heartbeat_failed", 11), ("heartbeat_failed", 11),
        ("heartbeat_failed", 0),
    ]
