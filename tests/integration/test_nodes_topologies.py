"""Topologies through the real nodes (ZMQ control, bootstrap HTTP, in-process fabric, checksums
on, so a Success means the decode recomputed every writer's digest over its own pages): MLA with
a dummy prefill rank, an MLA mismatch refused from the prefill's registered flag, and TP 1 -> 2."""

from __future__ import annotations

import ctypes
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import HostKvCache, RankKv, host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

GEOMETRY = {"num_layers": 2, "page_size": 4, "head_dim": 8, "dtype": KvDtype.FP16,
            "num_pages": 16}  # fmt: skip
PAGES = 3


def caches(tp: int, heads: int) -> list[tuple[HostKvCache, RankKv]]:
    return [host_cache_for_rank(total_kv_heads=heads, tp_size=tp, tp_rank=r, **GEOMETRY)
            for r in range(tp)]  # type: ignore[arg-type]  # fmt: skip


async def run_room(prefill_tp: int, decode_tp: int, heads: int, *, prefill_mla: bool,
                   decode_mla: bool) -> dict[str, Any]:  # fmt: skip
    settings = load_settings(trace_enabled=False, checksum=True)
    fabric = InProcessFabric()
    p_side, d_side = caches(prefill_tp, heads), caches(decode_tp, heads)
    for rank, (cache, _) in enumerate(p_side):  # each rank's KV differs: a wrong writer shows
        ctypes.memset(cache.base_addr, 0x31 + rank, cache.nbytes)
    async with (
        fabric.create_transport() as p_transport,
        fabric.create_transport() as d_transport,
        PrefillNode(ranks=[kv for _, kv in p_side], transport=p_transport,
                    bootstrap="127.0.0.1:0", settings=settings, is_mla=prefill_mla) as p_node,
        DecodeNode(ranks=[kv for _, kv in d_side], transport=d_transport, settings=settings,
                   is_mla=decode_mla) as d_node,
    ):  # fmt: skip
        room = 7
        for p_rank in p_node.ranks:
            await p_rank.open_room(room, 0)
        for d_rank in d_node.ranks:
            await d_rank.open(room, 0, p_node.bootstrap)
        opened = [await d_rank.wait(room) for d_rank in d_node.ranks]
        if any(s.poll is KVPoll.Failed for s in opened):
            for p_rank in p_node.ranks:
                await p_rank.abort(room, "the decode failed")
            return {"decode": [s.poll for s in opened], "reasons": [s.reason for s in opened]}
        for d_rank in d_node.ranks:
            await d_rank.publish_pages(room, [1, 2, 3])
        for p_rank in p_node.ranks:
            await p_rank.wait(room)
            await p_rank.init_transfer(room, PAGES)
            await p_rank.send_chunk(room, [4, 5, 6], is_last=True)
        final = [await d_rank.wait(room, terminal=True) for d_rank in d_node.ranks]
        sent = [p_rank.transfer_stats(room)[0] or 0 for p_rank in p_node.ranks]
        prefill = [await p_rank.wait(room, terminal=True) for p_rank in p_node.ranks]
        landed = [ctypes.string_at(cache.layout.page_addr(0, 1), cache.layout.item_len)
                  for cache, _ in d_side]  # fmt: skip
    return {
        "decode": [s.poll for s in final], "reasons": [s.reason for s in final],
        "prefill": [s.poll for s in prefill], "bytes_sent": sent, "landed": landed,
    }


def test_mla_tp2_to_tp1_reads_one_rank_and_the_other_is_a_dummy() -> None:
    result = anyio.run(lambda: run_room(2, 1, 1, prefill_mla=True, decode_mla=True),
                       backend="asyncio")  # fmt: skip
    assert result["decode"] == [KVPoll.Success], result["reasons"]
    assert result["prefill"] == [KVPoll.Success, KVPoll.Success], "the dummy rank finishes too"
    assert result["bytes_sent"][0] > 0 and result["bytes_sent"][1] == 0, "one writer, one dummy"
    assert set(result["landed"][0]) == {0x31}, "rank 0's latent KV, not a mix"


def test_an_mla_prefill_is_refused_by_an_mha_decode_from_its_registered_flag() -> None:
    result = anyio.run(lambda: run_room(2, 1, 1, prefill_mla=True, decode_mla=False),
                       backend="asyncio")  # fmt: skip
    assert result["decode"] == [KVPoll.Failed]
    assert "attention kind mismatch" in result["reasons"][0]
    assert "registered MLA" in result["reasons"][0]


def test_mha_tp1_to_tp2_writes_each_decode_rank_its_heads() -> None:
    result = anyio.run(lambda: run_room(1, 2, 4, prefill_mla=False, decode_mla=False),
                       backend="asyncio")  # fmt: skip
    assert result["decode"] == [KVPoll.Success, KVPoll.Success], result["reasons"]
    assert result["prefill"] == [KVPoll.Success]
    assert all(set(page) == {0x31} for page in result["landed"])
