"""Legitimate bursts against the control channel's small receive queue (RECEIVE_HWM): while a
prefill rank's receive loop is held up, ZMQ keeps only a few messages per connection and the
decode's own queue takes the rest; nothing is dropped or refused, and every room succeeds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.control import RECEIVE_HWM, Deliver
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric
from tests.integration.test_nodes_inprocess import GEOMETRY

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

ROOMS = 256
"""The benchmarks' concurrency: 256 rooms in flight at once."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def held_prefill(gate: anyio.Event, tmp: str) -> AsyncIterator[tuple[PrefillNode,
                                                                            DecodeNode]]:
    """A prefill of one rank whose receive loop delivers nothing until ``gate`` is set, and a
    decode with room for ROOMS rooms of two pages."""
    settings = load_settings(env={}, trace_dir=tmp, checksum=True)
    fabric = InProcessFabric()
    _p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=2 * ROOMS, **GEOMETRY)
    _d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=2 * ROOMS, **GEOMETRY)

    class HeldPrefill(PrefillNode):
        def _deliverer(self, *args: object) -> Deliver:
            deliver = super()._deliverer(*args)  # type: ignore[arg-type]

            async def held(*received: object) -> None:
                await gate.wait()
                await deliver(*received)  # type: ignore[arg-type]

            return held

    async with (
        fabric.create_transport() as p_transport, fabric.create_transport() as d_transport,
        HeldPrefill(ranks=[p_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings) as p_node,
        DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        yield p_node, d_node


async def test_a_burst_of_256_rooms_at_a_held_up_prefill_loses_no_message(
    tmp_path: anyio.Path,
) -> None:
    assert ROOMS > 4 * RECEIVE_HWM
    gate = anyio.Event()
    async with held_prefill(gate, str(tmp_path)) as (p_node, d_node):
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        for room in range(ROOMS):
            await p_rank.open_room(room, 0)
            await d_rank.open(room, 0, p_node.bootstrap)
        for room in range(ROOMS):
            await d_rank.wait(room)
            await d_rank.publish_pages(room, [2 * room, 2 * room + 1])
        await anyio.sleep(0.5)  # the burst sits in ZMQ's queues, the prefill reads nothing
        gate.set()
        for room in range(ROOMS):
            await p_rank.wait(room)
            await p_rank.init_transfer(room, 2)
            await p_rank.send_chunk(room, [2 * room, 2 * room + 1], True)
        with anyio.fail_after(60):
            for room in range(ROOMS):
                status = await d_rank.wait(room, terminal=True)
                assert status.poll is KVPoll.Success, status.reason
        for metrics in (p_node.runtime.metrics, d_node.runtime.metrics):
            assert metrics.value("pdflow_control_send_failures_total") == 0
            for reason in ("peer_stalled", "send_error", "connect_failed", "oversized"):
                assert metrics.value("pdflow_control_refused_sends_total",
                                     {"reason": reason}) == 0  # fmt: skip
