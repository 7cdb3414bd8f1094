"""The readiness hook: the prefill shell reads a chunk's source bytes only once the engine's
readiness object (SGLang's CUDA event after the forward pass; here a gate) says they are
written. Bytes the engine finishes after send_chunk, before the gate opens, are what land."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import Settings, load_settings
from tests.integration.node_harness import inprocess_nodes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL = {"total_kv_heads": 2, "num_layers": 2, "page_size": 4, "head_dim": 8,
         "dtype": KvDtype.FP16, "num_pages": 8}  # fmt: skip


class Gate:
    """A readiness object the test opens: ``synchronize`` blocks until then."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        assert self.opened.wait(20), "the gate was never opened"


@asynccontextmanager
async def one_pair(settings: Settings) -> AsyncIterator[tuple[PrefillNode, DecodeNode, Any]]:
    """A prefill and a decode (TP=1 each) on the in-process fabric, and the prefill's cache."""
    p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    # The decode's memory: held by this frame while its node runs, never read here.
    _d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    async with inprocess_nodes([p_kv], [d_kv], settings) as (p_node, d_node):
        yield p_node, d_node, p_cache


async def transfer() -> dict[str, object]:
    gate = Gate()
    async with one_pair(load_settings(trace_enabled=False, checksum=True)) as (
        p_node, d_node, p_cache,
    ):  # fmt: skip
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        d_kv = d_node.rank_kv[0]
        await p_rank.open_room(1, 0)
        await d_rank.open(1, 0, p_node.bootstrap)
        await d_rank.wait(1)
        await d_rank.publish_pages(1, [4, 5])
        await p_rank.wait(1)
        await p_rank.init_transfer(1, 2)
        ctypes.memset(p_cache.base_addr, 0x11, p_cache.nbytes)  # the kernel has not finished
        await p_rank.send_chunk(1, [0, 1], is_last=True, ready=gate)
        with anyio.move_on_after(0.5) as early:
            await d_rank.wait(1, terminal=True)
        ctypes.memset(p_cache.base_addr, 0x2A, p_cache.nbytes)  # now it has
        gate.opened.set()
        status = await d_rank.wait(1, terminal=True)
        layout = d_kv.token_layout
        landed = {ctypes.string_at(layout.page_addr(b, page), layout.item_len)
                  for b in range(len(layout.buffer_addrs)) for page in (4, 5)}  # fmt: skip
        await d_rank.clear(1)
        await p_rank.clear(1)
    return {"early": not early.cancel_called, "poll": status.poll, "reason": status.reason,
            "landed": landed, "waits": gate.waits, "item_len": layout.item_len}  # fmt: skip


def test_the_shell_reads_source_pages_only_after_the_engine_says_they_are_ready() -> None:
    result = anyio.run(transfer, backend="asyncio")
    assert not result["early"], "the room finished before its source bytes were ready"
    assert result["poll"] is KVPoll.Success, result["reason"]
    assert result["landed"] == {bytes([0x2A]) * result["item_len"]}, "bytes finished in time"
    assert result["waits"] == 1


class BrokenReadiness:
    """The engine's readiness object fails (a CUDA error surfacing at synchronize)."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def a_failed_readiness_then_a_healthy_room() -> dict[str, object]:
    outcomes: dict[str, object] = {}
    async with one_pair(load_settings(trace_enabled=False)) as (p_node, d_node, _):
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        for room, ready in ((1, BrokenReadiness()), (2, None)):
            await p_rank.open_room(room, 0)
            await d_rank.open(room, 0, p_node.bootstrap)
            await d_rank.wait(room)
            await d_rank.publish_pages(room, [2 * room, 2 * room + 1])
            await p_rank.wait(room)
            await p_rank.init_transfer(room, 2)
            await p_rank.send_chunk(room, [0, 1], is_last=True, ready=ready)
            with anyio.fail_after(10):
                status = await p_rank.wait(room, terminal=True)
                outcomes[f"prefill {room}"] = (status.poll, status.reason)
                outcomes[f"decode {room}"] = (await d_rank.wait(room, terminal=True)).poll
    return outcomes


def test_a_readiness_object_that_raises_fails_its_chunk_and_the_node_serves_on() -> None:
    """Raising out of the write job ended the node: every room of it, the engine's own
    ``async with`` included."""
    outcomes = anyio.run(a_failed_readiness_then_a_healthy_room, backend="asyncio")
    poll, reason = outcomes["prefill 1"]  # type: ignore[misc]
    assert poll is KVPoll.Failed and "illegal memory access" in reason
    assert outcomes["decode 1"] is KVPoll.Failed
    assert outcomes["prefill 2"][0] is KVPoll.Success  # type: ignore[index]
    assert outcomes["decode 2"] is KVPoll.Success
