"""Planning from engine-registered buffers against a brute-force reference.

Random models (tensors with their own layer ids, roles, TP splits, head sizes and page orders,
MLA latents and draft KV among them) on random prefill and decode TP sizes: every decode byte
of the published pages is written exactly once, with the byte the reference says (found by
walking tokens and heads one by one, not by the planner's slices); the digests of both sides
agree; the staged path lands the same bytes; and only the topology's writers write.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflow.core.cluster.topology import (
    AttentionKind,
    Parallelism,
    PdTopology,
    resolve_rank_mapping,
)
from pdflow.core.dataplane.buffers import (
    KvBuffer,
    KvBuffers,
    KvRole,
    PageOrder,
    TpPlace,
    destination_slices,
    exchanged_slices,
)
from pdflow.core.dataplane.layout import rank_head_range
from pdflow.core.dataplane.planning import WriteOp, plan_buffers
from pdflow.core.framework.errors import InvalidInput
from pdflow.dataplane.pure import PythonExecutor
from pdflow.io.kv_buffers import kv_digest, staged_slices, writer_region

TP_SIZES = (1, 2, 4)


class Tensor:
    def __init__(self, key: tuple[bool, KvRole, int], total_heads: int, head_bytes: int,
                 order: PageOrder) -> None:  # fmt: skip
        self.draft, self.role, self.layer = key
        self.total_heads, self.head_bytes, self.order = total_heads, head_bytes, order


TENSORS = st.lists(
    st.builds(
        Tensor,
        st.tuples(st.booleans(), st.sampled_from(KvRole), st.integers(0, 3)),
        st.sampled_from((1, 2, 4, 8)),
        st.integers(1, 5),
        st.sampled_from(PageOrder),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda t: (t.draft, t.role, t.layer),
)


def reference_byte(tensor_index: int, page: int, token: int, head: int, byte: int) -> int:
    return (tensor_index * 53 + page * 29 + token * 17 + head * 11 + byte * 3 + 1) % 251


def offset_in_page(tensor: Tensor, page_size: int, local_head: int, heads: int, token: int,
                   byte: int) -> int:  # fmt: skip
    """Where one (token, head, byte) sits in a page, walked out of the page order by hand."""
    if tensor.order is PageOrder.NHD:
        return (token * heads + local_head) * tensor.head_bytes + byte
    return (local_head * page_size + token) * tensor.head_bytes + byte


class Rank:
    """One rank's buffers in real memory (numpy arrays, so addresses are real)."""

    def __init__(self, tensors: list[Tensor], tp: TpPlace, page_size: int, num_pages: int,
                 order: list[int]) -> None:  # fmt: skip
        self.tp, self.page_size, self.num_pages = tp, page_size, num_pages
        self.tensors = tensors
        self.arrays: list[np.ndarray] = []
        buffers = []
        for index in order:  # each side lists the tensors in its own order
            tensor = tensors[index]
            heads = rank_head_range(tensor.total_heads, tp.size, tp.rank).count
            item_len = page_size * heads * tensor.head_bytes
            array = np.zeros(num_pages * item_len + 7, dtype=np.uint8)  # + slack past the pool
            self.arrays.append(array)
            buffers.append(KvBuffer(array.ctypes.data, array.size, item_len, tensor.layer,
                                    tensor.role, tensor.total_heads, tensor.draft,
                                    tensor.order))  # fmt: skip
        self.order = order
        self.kv = KvBuffers(page_size, tuple(buffers))

    def fill(self) -> None:
        for slot, index in enumerate(self.order):
            tensor, array = self.tensors[index], self.arrays[slot]
            heads = rank_head_range(tensor.total_heads, self.tp.size, self.tp.rank)
            item_len = self.kv.buffers[slot].item_len
            for page in range(self.num_pages):
                for token in range(self.page_size):
                    for local in range(heads.count):
                        for byte in range(tensor.head_bytes):
                            at = page * item_len + offset_in_page(
                                tensor, self.page_size, local, heads.count, token, byte)
                            array[at] = reference_byte(index, page, token, heads.start + local,
                                                       byte)  # fmt: skip

    def locate(self, addr: int) -> tuple[np.ndarray, int]:
        for array in self.arrays:
            if array.ctypes.data <= addr < array.ctypes.data + array.size:
                return array, addr - array.ctypes.data
        raise AssertionError(f"address {addr:#x} is in no buffer of this rank")


def apply(ops: tuple[WriteOp, ...], src: Rank, dst: Rank, counts: list[np.ndarray]) -> None:
    for op in ops:
        s_array, s_at = src.locate(op.src_addr)
        d_array, d_at = dst.locate(op.dst_addr)
        assert s_at + op.length <= s_array.size and d_at + op.length <= d_array.size
        d_array[d_at : d_at + op.length] = s_array[s_at : s_at + op.length]
        counts[[a.ctypes.data for a in dst.arrays].index(d_array.ctypes.data)][
            d_at : d_at + op.length] += 1  # fmt: skip


def expected_decode(dst: Rank, src_pages: list[int], dst_pages: list[int]) -> list[np.ndarray]:
    """Reference bytes and which bytes must be written, by walking every byte."""
    wanted = [np.zeros_like(a) for a in dst.arrays]
    for slot, index in enumerate(dst.order):
        tensor = dst.tensors[index]
        heads = rank_head_range(tensor.total_heads, dst.tp.size, dst.tp.rank)
        item_len = dst.kv.buffers[slot].item_len
        for s_page, d_page in zip(src_pages, dst_pages, strict=True):
            for token in range(dst.page_size):
                for local in range(heads.count):
                    for byte in range(tensor.head_bytes):
                        at = d_page * item_len + offset_in_page(
                            tensor, dst.page_size, local, heads.count, token, byte)
                        wanted[slot][at] = reference_byte(index, s_page, token,
                                                          heads.start + local, byte)  # fmt: skip
    return wanted


MODELS = st.tuples(
    TENSORS,
    st.sampled_from(TP_SIZES),
    st.sampled_from(TP_SIZES),
    st.sampled_from((1, 2, 4)),
    st.randoms(use_true_random=False),
)


def filled_prefill(model: tuple, num_pages: int,
                   min_pages: int) -> tuple[list[Rank], list[int], list[int]]:  # fmt: skip
    """Every prefill rank of the model, filled, and a random chunk's page pairs."""
    tensors, prefill_tp, _, page_size, rng = model
    count = rng.randint(min_pages, num_pages)
    src_pages = rng.sample(range(num_pages), count)
    dst_pages = rng.sample(range(num_pages), count)
    order = list(range(len(tensors)))
    prefill = [Rank(tensors, TpPlace(prefill_tp, r), page_size, num_pages, order)
               for r in range(prefill_tp)]  # fmt: skip
    for rank in prefill:
        rank.fill()
    return prefill, src_pages, dst_pages


@settings(max_examples=60, deadline=None)
@given(MODELS)
def test_every_decode_byte_is_written_once_with_the_reference_byte(model: tuple) -> None:
    tensors, prefill_tp, decode_tp, page_size, _ = model
    num_pages = 5
    prefill, src_pages, dst_pages = filled_prefill(model, num_pages, min_pages=0)
    decode_order = list(range(len(tensors)))[::-1]
    topology = PdTopology(Parallelism(tp=prefill_tp), Parallelism(tp=decode_tp), AttentionKind.MHA,
                          num_kv_heads=max(t.total_heads for t in tensors))  # fmt: skip
    executor = PythonExecutor()
    for d in range(decode_tp):
        decode = Rank(tensors, TpPlace(decode_tp, d), page_size, num_pages, decode_order)
        counts = [np.zeros(a.size, dtype=np.int64) for a in decode.arrays]
        writers = set()
        sent: dict[int, int] = {}
        for src in prefill:
            ops = plan_buffers(src.kv, src.tp, decode.kv, decode.tp, src_pages, dst_pages)
            apply(ops, src, decode, counts)
            if exchanged_slices(src.kv, True, src.tp, decode.tp, decode.kv):
                writers.add(src.tp.rank)
                sent[src.tp.rank] = kv_digest(
                    executor, exchanged_slices(src.kv, True, src.tp, decode.tp, decode.kv),
                    src_pages, dst_pages, decode.kv.num_pages)  # fmt: skip
        wanted = expected_decode(decode, src_pages, dst_pages)
        for slot, index in enumerate(decode.order):
            tensor = tensors[index]
            heads = rank_head_range(tensor.total_heads, decode_tp, d)
            item_len = page_size * heads.count * tensor.head_bytes
            must = np.zeros(decode.arrays[slot].size, dtype=np.int64)
            for page in dst_pages:
                must[page * item_len : (page + 1) * item_len] = 1
            assert (counts[slot] == must).all(), f"tensor {index}: bytes written not once"
            assert (decode.arrays[slot] == wanted[slot]).all(), f"tensor {index}: wrong bytes"
        # Each writer's digest, recomputed by the decode over what landed, matches its own.
        for rank, digest in sent.items():
            slices = destination_slices(decode.kv, TpPlace(prefill_tp, rank), decode.tp)
            assert kv_digest(executor, slices, dst_pages, dst_pages,
                             decode.kv.num_pages) == digest  # fmt: skip
        # Only the topology's writers write; its dummies (MLA's other ranks) write nothing.
        mapping = resolve_rank_mapping(topology, decode_engine_rank=d, room=0)
        assert writers == {t.rank.tp for t in mapping.writers}


@settings(max_examples=40, deadline=None)
@given(MODELS)
def test_the_staged_path_lands_the_same_bytes_in_disjoint_writer_regions(model: tuple) -> None:
    tensors, _, decode_tp, page_size, _ = model
    num_pages = 4
    prefill, src_pages, dst_pages = filled_prefill(model, num_pages, min_pages=1)
    count, order = len(src_pages), list(range(len(tensors)))
    executor = PythonExecutor()
    for d in range(decode_tp):
        decode = Rank(tensors, TpPlace(decode_tp, d), page_size, num_pages, order[::-1])
        ring = np.zeros(count * decode.kv.page_bytes, dtype=np.uint8)
        claimed = np.zeros(ring.size, dtype=np.int64)
        for src in prefill:
            region = writer_region(src.kv, True, src.tp, decode.tp, decode.kv)
            seen = writer_region(decode.kv, False, src.tp, decode.tp, decode.kv)
            assert (region is None) == (seen is None)
            if region is None or seen is None:
                continue
            assert (region.before, region.page_bytes) == (seen.before, seen.page_bytes)
            slot = np.zeros(count * region.page_bytes, dtype=np.uint8)
            for page_slices in staged_slices(region, src_pages, slot.ctypes.data):
                executor.gather(page_slices)
            at = region.chunk_offset(count, 0)
            ring[at : at + slot.size] = slot
            claimed[at : at + slot.size] += 1
            for page_slices in staged_slices(seen, dst_pages, ring.ctypes.data + at):
                executor.scatter(page_slices)
        assert (claimed == 1).all(), "writer regions must tile the room's staging bytes"
        wanted = expected_decode(decode, src_pages, dst_pages)
        for slot_index, array in enumerate(decode.arrays):
            assert (array == wanted[slot_index]).all()


def test_an_mla_latent_comes_whole_from_one_prefill_rank_the_others_are_dummies() -> None:
    latent = [Tensor((False, KvRole.LATENT, layer), 1, 4, PageOrder.NHD) for layer in range(3)]
    prefill = [Rank(latent, TpPlace(4, r), 2, 3, [0, 1, 2]) for r in range(4)]
    decode = [Rank(latent, TpPlace(2, d), 2, 3, [2, 0, 1]) for d in range(2)]
    planned = {(s.tp.rank, d.tp.rank): plan_buffers(s.kv, s.tp, d.kv, d.tp, [0, 1], [2, 0])
               for s in prefill for d in decode}  # fmt: skip
    writers = {pair for pair, ops in planned.items() if ops}
    assert writers == {(0, 0), (2, 1)}, "the first rank of each decode rank's group writes"
    # The whole latent page of every layer: 2 pages x 3 layers, as 3 ops per page (2 not adjacent).
    assert sum(op.length for op in planned[(0, 0)]) == 2 * 3 * decode[0].kv.buffers[0].item_len
    assert len(planned[(0, 0)]) == 6


def test_head_major_pages_move_one_run_per_page_token_major_one_per_token() -> None:
    for order, runs_per_page in ((PageOrder.HND, 1), (PageOrder.NHD, 4)):
        tensor = [Tensor((False, KvRole.K, 0), 4, 2, order)]
        src = Rank(tensor, TpPlace(2, 1), 4, 4, [0])
        dst = Rank(tensor, TpPlace(1, 0), 4, 4, [0])
        ops = plan_buffers(src.kv, src.tp, dst.kv, dst.tp, [0, 1, 2], [1, 2, 3])
        assert len(ops) == 3 * runs_per_page
        assert {op.length for op in ops} == {2 * 2 * (4 // runs_per_page)}


def test_per_layer_item_lengths_and_disagreeing_descriptions() -> None:
    two = [Tensor((False, KvRole.K, 0), 2, 3, PageOrder.NHD),
           Tensor((False, KvRole.K, 1), 2, 5, PageOrder.NHD)]  # fmt: skip
    src = Rank(two, TpPlace(1, 0), 2, 2, [0, 1])
    dst = Rank(two, TpPlace(1, 0), 2, 2, [1, 0])
    assert [b.item_len for b in src.kv.buffers] == [12, 20]
    ops = plan_buffers(src.kv, src.tp, dst.kv, dst.tp, [0], [1])
    assert [op.length for op in ops] == [20, 12], "destination order, each its own item length"
    other = Rank([two[0], Tensor((False, KvRole.V, 1), 2, 5, PageOrder.NHD)], TpPlace(1, 0), 2,
                 2, [0, 1])  # fmt: skip
    with pytest.raises(InvalidInput, match="different KV tensors"):
        plan_buffers(src.kv, src.tp, other.kv, other.tp, [0], [1])
    hnd = Rank([two[0], Tensor((False, KvRole.K, 1), 2, 5, PageOrder.HND)], TpPlace(1, 0), 2, 2,
               [0, 1])  # fmt: skip
    with pytest.raises(InvalidInput, match="order nhd vs hnd"):
        plan_buffers(src.kv, src.tp, hnd.kv, hnd.tp, [0], [1])


def test_a_pipeline_stage_writes_only_the_layers_it_holds() -> None:
    layers = [Tensor((False, role, layer), 2, 4, PageOrder.NHD)
              for layer in range(2) for role in (KvRole.K, KvRole.V)]  # fmt: skip
    stage = Rank(layers[:2], TpPlace(1, 0), 2, 3, [0, 1])  # layer 0 only
    whole = Rank(layers, TpPlace(1, 0), 2, 3, [0, 1, 2, 3])
    ops = plan_buffers(stage.kv, stage.tp, whole.kv, whole.tp, [0, 2], [1, 2], stage=True)
    landed = {whole.locate(op.dst_addr)[0].ctypes.data for op in ops}
    assert landed == {a.ctypes.data for a in whole.arrays[:2]}, "layer 0's K and V, nothing else"
    with pytest.raises(InvalidInput, match="different KV tensors"):
        plan_buffers(stage.kv, stage.tp, whole.kv, whole.tp, [0], [1])
