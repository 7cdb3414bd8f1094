"""Chaos finding 2: a standalone registry (`pdflow bootstrap`) that restarts comes back empty.
The prefill notices its ranks are gone and registers them again, with the same incarnation, so
rooms succeed again without restarting the prefill or the decode."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import Process

from pdflow.transport.mooncake import MooncakeTransport
from tests.ports import free_port

from .node_harness import decode_engine, prefill_process

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def registry_process(port: int) -> AsyncIterator[Process]:
    """`pdflow bootstrap` as its own process, answering /health once it listens."""
    process = await anyio.open_process(
        [sys.executable, "-m", "pdflow.cli", "bootstrap", "--host", "127.0.0.1",
         "--port", str(port)], stdout=None, stderr=None,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as client:
            with anyio.fail_after(20):
                while True:
                    try:
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await anyio.sleep(0.05)
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await process.aclose()


async def test_a_restarted_registry_is_registered_again_and_rooms_succeed(
    tmp_path: anyio.Path,
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    settings: dict[str, Any] = {"trace_dir": str(tmp_path), "heartbeat_interval": 0.3,
                                "heartbeat_max_failure": 2}  # fmt: skip
    transport = MooncakeTransport.open()
    options = {"bootstrap": address, "serve_bootstrap": False, "settings": settings,
               "num_pages": 64}  # fmt: skip
    async with anyio.create_task_group() as tasks, transport, AsyncExitStack() as first_life:
        await first_life.enter_async_context(registry_process(port))
        async with (
            prefill_process(tasks, options) as prefill,
            decode_engine(tasks, transport, settings, num_pages=64) as engine,
        ):
            await prefill.start_room(1, 0, 24)
            with anyio.fail_after(20):
                assert await engine.run_room(address, 1, 0, 24) == "Success"
            await first_life.aclose()  # the registry is killed: its state is lost
            await anyio.sleep(1.0)  # the decode's heartbeat loses the instance meanwhile
            async with registry_process(port):  # restarted, empty
                outcome = "not run"
                with anyio.fail_after(30):
                    for room in range(2, 100):
                        await prefill.start_room(room, 0, 24)
                        outcome = await engine.run_room(address, room, 0, 24)
                        if outcome == "Success":
                            break
                assert outcome == "Success", "rooms never succeeded after the restart"
                assert engine.corrupt == []
        tasks.cancel_scope.cancel()
