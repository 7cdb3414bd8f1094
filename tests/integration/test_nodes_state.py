"""Model state through the real nodes: a Mamba slot (conv and SSM buffers), the pages of a
sliding-window layer's live window and an opaque per-request blob move with the last chunk into
the indices the decode published, covered by the end-to-end checksum (on: Success means the
decode recomputed the digest over its own state items)."""

from __future__ import annotations

import ctypes
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

from pdflow.core.dataplane.buffers import TpPlace
from pdflow.core.dataplane.layout import (
    KvDtype,
    MambaSlot,
    StateBuffers,
    StateKind,
    SwaWindow,
    rank_head_range,
)
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.dataplane.pure import PythonExecutor
from pdflow.io.kv_buffers import host_cache_for_rank, state_digest, state_slices
from pdflow.io.settings import load_settings

from .node_harness import inprocess_nodes, inprocess_room

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL = {"total_kv_heads": 2, "num_layers": 1, "page_size": 4, "head_dim": 8,
         "dtype": KvDtype.FP16, "num_pages": 8}  # fmt: skip
SEQ, WINDOW = 11, 6


class HostState:
    """A Mamba component (conv, SSM), a sliding-window pool and a blob pool in host memory."""

    def __init__(self) -> None:
        self.memory = [(ctypes.c_uint8 * size)() for size in (8 * 48, 8 * 96, 16 * 64, 8 * 32)]
        addr = [ctypes.addressof(m) for m in self.memory]
        self.components = (
            StateBuffers(StateKind.MAMBA, (addr[0], addr[1]), (48, 96), 8),
            StateBuffers(StateKind.SWA, (addr[2],), (64,), 16),
            StateBuffers(StateKind.BLOB, (addr[3],), (32,), 8),
        )

    def item(self, component: int, buffer: int, index: int) -> bytes:
        state = self.components[component]
        return ctypes.string_at(state.item_addr(buffer, index), state.item_lens[buffer])

    def fill(self) -> None:
        for c, state in enumerate(self.components):
            for b, length in enumerate(state.item_lens):
                for index in range(state.num_items):
                    ctypes.memset(state.item_addr(b, index), (31 * c + 7 * b + index) % 251 + 1,
                                  length)  # fmt: skip


def indices(slot: int, swa_first_slot: int, blob: int) -> tuple[tuple[int, ...], ...]:
    """A request's state indices: its Mamba slot, its live SWA window's pages, its blob slot."""
    swa_slots = list(range(swa_first_slot * 4, swa_first_slot * 4 + SEQ))
    window = SwaWindow.derive(swa_slots, prefix_len=0, window=WINDOW, page_size=4)
    assert window.start_token == 4, "max(0, 11 - 6) = 5, rounded down to its page"
    return (MambaSlot(slot).indices(), window.indices(), (blob,))


async def transfer(send_state: bool) -> dict[str, Any]:
    settings = load_settings(trace_enabled=False, checksum=True)
    p_state, d_state = HostState(), HostState()
    p_state.fill()
    p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    p_kv = msgspec.structs.replace(p_kv, state=p_state.components)
    d_kv = msgspec.structs.replace(d_kv, state=d_state.components)
    src, dst = indices(2, 1, 5), indices(6, 3, 0)
    async with inprocess_room(p_kv, d_kv, settings) as (p_rank, d_rank):
        await d_rank.publish_pages(1, [4, 5, 6], state_indices=dst)
        await p_rank.wait(1)
        await p_rank.init_transfer(1, 3)
        await p_rank.send_chunk(1, [0, 1], is_last=False)
        try:
            await p_rank.send_chunk(1, [2], is_last=True, state_indices=src if send_state else ())
        except InvalidInput as exc:
            await p_rank.abort(1, "state withheld")
            return {"refused": str(exc)}
        status = await d_rank.wait(1, terminal=True)
        del p_cache, d_cache
    pairs = [
        (p_state.item(c, b, s), d_state.item(c, b, d))
        for c, state in enumerate(p_state.components)
        for b in range(len(state.addrs))
        for s, d in zip(src[c], dst[c], strict=True)
    ]
    return {"poll": status.poll, "reason": status.reason, "pairs": pairs}


def test_mamba_swa_and_blob_state_land_in_the_decodes_indices() -> None:
    result = anyio.run(transfer, True, backend="asyncio")
    assert result["poll"] is KVPoll.Success, result["reason"]
    assert len(result["pairs"]) == 2 + 2 + 1, "conv and SSM items, two window pages, one blob"
    assert all(src == dst for src, dst in result["pairs"])


def test_a_decode_that_published_state_refuses_a_last_chunk_without_it() -> None:
    result = anyio.run(transfer, False, backend="asyncio")
    assert "state indices of sizes []" in result["refused"]


def test_the_state_digest_sees_a_changed_item_and_an_item_in_the_wrong_place() -> None:
    state = HostState()
    state.fill()
    executor = PythonExecutor()
    chosen = indices(2, 1, 5)
    cuts = state_slices(state.components, False, TpPlace(1, 0), TpPlace(1, 0))
    base = state_digest(executor, cuts, chosen, chosen)
    moved = state_digest(executor, cuts, chosen, indices(3, 1, 5))
    assert moved != base, "the same bytes keyed to another slot"
    ctypes.memset(state.components[2].item_addr(0, 5), 0, 1)
    assert state_digest(executor, cuts, chosen, chosen) != base


# ---- across TP sizes ---------------------------------------------------------------------------
# (kind, [(total heads, bytes per head)] per buffer, tokens per item, items): a Mamba slot whose
# conv and SSM states split over 4 heads, an SWA pool of pages (4 tokens x 2 heads) and a blob.
SPLIT_STATE = (
    (StateKind.MAMBA, [(4, 6), (4, 12)], 1, 8),
    (StateKind.SWA, [(2, 8)], 4, 16),
    (StateKind.BLOB, [(1, 32)], 1, 8),
)


class SplitState:
    """One TP rank's share of SPLIT_STATE; byte (item, token, global head, offset) of buffer b
    of component c is a function of all of them, so replicas agree and a decode can check."""

    def __init__(self, tp_size: int, tp_rank: int) -> None:
        self.memory: list[Any] = []
        self.shape: list[list[tuple[int, int, int, int]]] = []  # per buffer: items, t, heads, B
        self.starts: list[list[int]] = []
        components = []
        for kind, buffers, tokens, items in SPLIT_STATE:
            addrs, lens, shapes, starts = [], [], [], []
            for total, head_bytes in buffers:
                heads = rank_head_range(total, tp_size, tp_rank)
                length = tokens * heads.count * head_bytes
                memory = (ctypes.c_uint8 * (items * length))()
                self.memory.append(memory)
                addrs.append(ctypes.addressof(memory))
                lens.append(length)
                shapes.append((items, tokens, heads.count, head_bytes))
                starts.append(heads.start)
            components.append(StateBuffers(kind, tuple(addrs), tuple(lens), items,
                                           tuple(t for t, _ in buffers), tokens))  # fmt: skip
            self.shape.append(shapes)
            self.starts.append(starts)
        self.components = tuple(components)

    def view(self, c: int, b: int) -> np.ndarray:
        component = self.components[c]
        size = component.num_items * component.item_lens[b]
        data = (ctypes.c_uint8 * size).from_address(component.addrs[b])
        return np.frombuffer(data, dtype=np.uint8).reshape(self.shape[c][b])

    def pattern(self, c: int, b: int, item: int) -> np.ndarray:
        _, tokens, heads, head_bytes = self.shape[c][b]
        t = np.arange(tokens).reshape(-1, 1, 1)
        h = np.arange(self.starts[c][b], self.starts[c][b] + heads).reshape(1, -1, 1)
        d = np.arange(head_bytes).reshape(1, 1, -1)
        return ((c * 61 + b * 37 + item * 19 + t * 13 + h * 7 + d) % 251 + 1).astype(np.uint8)

    def fill(self) -> None:
        for c, component in enumerate(self.components):
            for b in range(len(component.addrs)):
                for item in range(component.num_items):
                    self.view(c, b)[item] = self.pattern(c, b, item)


async def transfer_across_tp(prefill_tp: int, decode_tp: int) -> list[str]:
    """Mamba, SWA and blob state from TP ``prefill_tp`` into TP ``decode_tp``; the decode
    components that did not get the source items' bytes for their heads."""
    settings = load_settings(trace_enabled=False, checksum=True)
    model = {**MODEL, "total_kv_heads": 4}
    p_states = [SplitState(prefill_tp, r) for r in range(prefill_tp)]
    d_states = [SplitState(decode_tp, r) for r in range(decode_tp)]
    for state in p_states:
        state.fill()
    p_caches = [host_cache_for_rank(tp_size=prefill_tp, tp_rank=r, **model)  # type: ignore[arg-type]
                for r in range(prefill_tp)]
    p_kv = [msgspec.structs.replace(kv, state=p_states[r].components)
            for r, (_, kv) in enumerate(p_caches)]  # fmt: skip
    d_caches = [host_cache_for_rank(tp_size=decode_tp, tp_rank=r, **model)  # type: ignore[arg-type]
                for r in range(decode_tp)]
    d_kv = [msgspec.structs.replace(kv, state=d_states[r].components)
            for r, (_, kv) in enumerate(d_caches)]  # fmt: skip
    src, dst = ((3,), (1, 2), (6,)), ((5,), (7, 0), (2,))
    async with inprocess_nodes(p_kv, d_kv, settings) as (p_node, d_node):
        for rank in p_node.ranks:
            await rank.open_room(1, 0)
        for rank in d_node.ranks:
            await rank.open(1, 0, p_node.bootstrap)
            await rank.wait(1)
            await rank.publish_pages(1, [4, 5], state_indices=dst)
        for rank in p_node.ranks:
            await rank.wait(1)
            await rank.init_transfer(1, 2)
            await rank.send_chunk(1, [0, 1], is_last=True, state_indices=src)
        for rank in d_node.ranks:
            status = await rank.wait(1, terminal=True)
            assert status.poll is KVPoll.Success, status.reason
    del p_caches, d_caches  # the KV memory lives until here
    wrong = []
    for r, state in enumerate(d_states):
        for c, component in enumerate(state.components):
            for b in range(len(component.addrs)):
                for s, d in zip(src[c], dst[c], strict=True):
                    if not np.array_equal(state.view(c, b)[d], state.pattern(c, b, s)):
                        wrong.append(f"rank {r}: {component.kind.value} buffer {b} item {d}")
    return wrong


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_mamba_swa_and_blob_state_are_split_by_the_tp_rule_across_tp_sizes(
    prefill_tp: int, decode_tp: int
) -> None:
    assert anyio.run(transfer_across_tp, prefill_tp, decode_tp, backend="asyncio") == []
