"""Nodes for real: a prefill process (TP=2) and a decode node over Mooncake TCP on loopback."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from pdflow.transport.mooncake import MooncakeTransport

from .node_harness import decode_engine, prefill_process

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def node_settings(tmp: str, **extra: object) -> dict[str, Any]:
    return {"trace_dir": tmp, "checksum": True, "heartbeat_interval": 0.5,
            "heartbeat_max_failure": 2, **extra}  # fmt: skip


# Head slices are one Mooncake op per (buffer, page, token): the slow baseline, so fewer rooms.
@pytest.mark.parametrize(
    ("decode_tp", "count"), [(2, 200), (1, 40)], ids=["tp2-whole-pages", "tp1-head-slices"]
)
async def test_concurrent_rooms_succeed_verified_without_leaks(
    tmp_path: anyio.Path, decode_tp: int, count: int
) -> None:
    rng = random.Random(decode_tp)
    settings = node_settings(str(tmp_path))
    transport = MooncakeTransport.open()
    options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 4096}
    async with anyio.create_task_group() as tasks, transport:  # noqa: SIM117 - tasks first
        async with prefill_process(tasks, options) as prefill:
            bootstrap = prefill.ready["bootstrap"]
            async with decode_engine(tasks, transport, settings, tp=decode_tp,
                                     num_pages=4096) as engine:  # fmt: skip
                node = engine.node
                outcomes: dict[int, str] = {}

                async def room(room_id: int) -> None:
                    tokens = rng.randint(1, 300)
                    await prefill.start_room(room_id, 1, tokens)
                    outcomes[room_id] = await engine.run_room(bootstrap, room_id, 1, tokens)

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as rooms:
                        for room_id in range(1000, 1000 + count):
                            rooms.start_soon(room, room_id)
                    for room_id in range(1000, 1000 + count):
                        await prefill.room_done[room_id].wait()
                assert set(outcomes.values()) == {"Success"}, outcomes
                assert engine.corrupt == []
                assert engine.verified == count * decode_tp
                assert all(r == ["Success"] * 2 for r in prefill.rooms.values()), prefill.rooms
                assert await engine.settled_leak_report() == []
                metrics = node.runtime.metrics
                assert (
                    metrics.value("pdflow_rooms_total", {"outcome": "success"}) == count * decode_tp
                )
                assert metrics.value("pdflow_step_errors_total", {"input": "ChecksumChecked"}) == 0
            tasks.cancel_scope.cancel()
