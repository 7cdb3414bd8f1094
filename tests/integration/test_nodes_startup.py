"""Start-up races: a decode asking before the registry is ready, a prefill registering before
the registry listens. Both sides retry; nothing has to start first."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.bootstrap_server import serve
from pdflow.transport.mooncake import MooncakeTransport
from tests.ports import free_port

from .node_harness import decode_engine, prefill_process

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_decode_waits_through_503_until_the_prefill_registers(tmp_path: anyio.Path) -> None:
    settings: dict[str, Any] = {"trace_dir": str(tmp_path), "checksum": True}
    transport = MooncakeTransport.open()
    # A registry with no incarnation of its own: the heartbeat must not read it as a restart.
    async with anyio.create_task_group() as tasks, transport, serve("127.0.0.1", 0) as registry:
        async with decode_engine(tasks, transport, settings, num_pages=64) as engine:
            node = engine.node
            outcome: list[str] = []

            async def decode_room() -> None:
                outcome.append(await engine.run_room(registry.address, 7, 0, 40))

            tasks.start_soon(decode_room)
            await anyio.sleep(1.0)  # the registry answers 503 meanwhile: no rank registered
            assert node.ranks[0].poll(7) is KVPoll.Bootstrapping
            options = {"bootstrap": registry.address, "serve_bootstrap": False,
                       "settings": settings, "num_pages": 64}  # fmt: skip
            async with prefill_process(tasks, options) as prefill:
                await prefill.start_room(7, 0, 40)
                with anyio.fail_after(20):
                    while not outcome:
                        await anyio.sleep(0.02)
            assert outcome == ["Success"]
            assert engine.corrupt == []
            assert await engine.settled_leak_report() == []
        tasks.cancel_scope.cancel()


async def test_prefill_registration_retries_until_the_registry_binds(
    tmp_path: anyio.Path,
) -> None:
    settings: dict[str, Any] = {"trace_dir": str(tmp_path)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    transport = MooncakeTransport.open()
    registry_up = anyio.Event()
    stop_registry = anyio.Event()

    async def late_registry() -> None:
        await anyio.sleep(1.5)
        async with serve("127.0.0.1", port):
            registry_up.set()
            await stop_registry.wait()

    async with anyio.create_task_group() as tasks, transport:
        tasks.start_soon(late_registry)
        options = {"bootstrap": address, "serve_bootstrap": False, "settings": settings,
                   "num_pages": 64}  # fmt: skip
        async with prefill_process(tasks, options) as prefill:  # ready = registered
            assert registry_up.is_set()
            async with decode_engine(tasks, transport, settings, num_pages=64) as engine:
                await prefill.start_room(3, 0, 20)
                with anyio.fail_after(20):
                    assert await engine.run_room(address, 3, 0, 20) == "Success"
                assert engine.corrupt == []
        stop_registry.set()
        tasks.cancel_scope.cancel()
