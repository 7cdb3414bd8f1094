"""Topologies through the real nodes (ZMQ control, bootstrap HTTP, in-process fabric, checksums
on, so a Success means the decode recomputed every writer's digest over its own pages): MLA with
a dummy prefill rank, an MLA mismatch refused from the prefill's registered flag, TP 1 -> 2, DP 2
(follow_bootstrap_room, and registered DP ranks) and CP 2."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import HostKvCache, RankKv, host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode, PrefillPlacement
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


# ---- DP and CP: one prefill node per (DP group, CP rank), one registry ---------------------------
Outcome = tuple[KVPoll, str, set[int]]
"""A room's final decode poll, its reason, and the bytes that landed in its page."""


@contextlib.asynccontextmanager
async def prefill_groups(placements: list[PrefillPlacement],
                         fabric: InProcessFabric) -> AsyncIterator[list[PrefillNode]]:  # fmt: skip
    """Prefill nodes of one instance (TP 1 each), the first hosting the registry; group ``i``'s
    KV is all ``0x41 + i`` bytes."""
    settings = load_settings(trace_enabled=False, checksum=True)
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[PrefillNode] = []
        for index, placement in enumerate(placements):
            cache, kv = caches(1, 4)[0]
            ctypes.memset(cache.base_addr, 0x41 + index, cache.nbytes)
            stack.callback(lambda keep=cache: keep)  # the memory lives as long as the node
            transport = await stack.enter_async_context(fabric.create_transport())
            node = await stack.enter_async_context(PrefillNode(
                ranks=[kv], transport=transport, settings=settings, placement=placement,
                bootstrap=nodes[0].bootstrap if nodes else "127.0.0.1:0",
                serve_bootstrap=not nodes,
            ))  # fmt: skip
            nodes.append(node)
        yield nodes


async def serve_rooms(nodes: list[PrefillNode], rooms: dict[int, int],
                      fabric: InProcessFabric) -> dict[int, Outcome]:  # fmt: skip
    """Each room opened on node ``rooms[room]`` (and a dummy-only node's ranks wherever the
    decode sends metadata), received by a TP 1 decode; the poll, reason and bytes that landed."""
    settings = load_settings(trace_enabled=False, checksum=True)
    d_cache, d_kv = caches(1, 4)[0]
    out: dict[int, Outcome] = {}
    async with (
        fabric.create_transport() as d_transport,
        DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        d_rank = d_node.ranks[0]
        for slot, (room, index) in enumerate(rooms.items()):
            senders = [rank for node in nodes for rank in node.ranks
                       if node is nodes[index] or node.placement.cp_rank]  # fmt: skip
            for p_rank in senders:
                await p_rank.open_room(room, 0)
            await d_rank.open(room, 0, nodes[0].bootstrap)
            await d_rank.wait(room)
            page = 1 + slot
            await d_rank.publish_pages(room, [page])
            for p_rank in senders:
                await p_rank.wait(room)
                await p_rank.init_transfer(room, 1)
                await p_rank.send_chunk(room, [2], is_last=True)
            status = await d_rank.wait(room, terminal=True)
            for p_rank in senders:
                await p_rank.wait(room, terminal=True)
            layout = d_cache.layout
            landed = set(ctypes.string_at(layout.page_addr(0, page), layout.item_len))
            out[room] = (status.poll, status.reason, landed)
    return out


def test_dp2_follows_the_bootstrap_room_to_its_dp_group() -> None:
    async def main() -> tuple[dict[int, Outcome], str]:
        fabric = InProcessFabric()
        placements = [PrefillPlacement(dp_size=2, dp_rank=dp) for dp in range(2)]
        async with prefill_groups(placements, fabric) as nodes:
            try:
                await nodes[0].ranks[0].open_room(5, 0)
                refused = ""
            except InvalidInput as exc:
                refused = str(exc)
            return await serve_rooms(nodes, {4: 0, 5: 1}, fabric), refused

    rooms, refused = anyio.run(main, backend="asyncio")
    assert rooms[4][:2] == (KVPoll.Success, "") and rooms[4][2] == {0x41}, "DP group 0's KV"
    assert rooms[5][:2] == (KVPoll.Success, "") and rooms[5][2] == {0x42}, "DP group 1's KV"
    assert "room 5 belongs to prefill DP rank 1" in refused


def test_dp2_with_registered_dp_ranks_reaches_the_group_that_registered_the_room() -> None:
    async def main() -> dict[int, Outcome]:
        fabric = InProcessFabric()
        placements = [PrefillPlacement(dp_size=2, dp_rank=dp, load_balance_method="round_robin")
                      for dp in range(2)]  # fmt: skip
        async with prefill_groups(placements, fabric) as nodes:
            # Against room % dp: only /register_dp_rank + /query_dp_ranks can route these.
            return await serve_rooms(nodes, {4: 1, 7: 0}, fabric)

    rooms = anyio.run(main, backend="asyncio")
    assert rooms[4][:2] == (KVPoll.Success, "") and rooms[4][2] == {0x42}
    assert rooms[7][:2] == (KVPoll.Success, "") and rooms[7][2] == {0x41}


def test_cp2_pulls_from_cp_rank_0_and_the_other_cp_rank_is_a_dummy() -> None:
    async def main() -> dict[int, Outcome]:
        fabric = InProcessFabric()
        placements = [PrefillPlacement(cp_size=2, cp_rank=cp) for cp in range(2)]
        async with prefill_groups(placements, fabric) as nodes:
            result = await serve_rooms(nodes, {3: 0}, fabric)
            sent = [node.ranks[0].transfer_stats(3)[0] or 0 for node in nodes]
            assert sent[0] > 0 and sent[1] == 0, sent
            return result

    rooms = anyio.run(main, backend="asyncio")
    assert rooms[3][:2] == (KVPoll.Success, "") and rooms[3][2] == {0x41}
