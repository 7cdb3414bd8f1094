"""Transfer plans simulated on bytearrays: every byte moved once, to the right place."""

import itertools
import os
import random
from typing import NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st

from pdflow.core.dataplane.layout import KvDtype, KvLayout, rank_head_range
from pdflow.core.dataplane.planning import (
    StagedSlices,
    WriteOp,
    plan_head_slices,
    plan_pages,
    plan_staged,
    split_batches,
)

EXAMPLES = settings(max_examples=int(os.environ.get("PDFLOW_EXAMPLES", "60")), deadline=None)


class Geometry(NamedTuple):
    layers: int
    page_size: int
    head_dim: int
    dtype: KvDtype


geometries = st.builds(
    Geometry,
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from(list(KvDtype)),
)


@st.composite
def layouts(draw: st.DrawFn, *, heads: int, geometry: Geometry) -> KvLayout:
    """A layout whose buffers are shuffled, with gaps, inside one simulated address space."""
    layers, page_size, head_dim, dtype = geometry
    num_pages = draw(st.integers(1, 10))
    buffer_bytes = num_pages * page_size * heads * head_dim * dtype.itemsize
    order = draw(st.permutations(range(2 * layers)))
    gaps = draw(st.lists(st.integers(0, 3), min_size=2 * layers, max_size=2 * layers))
    addrs = [0] * (2 * layers)
    cursor = 0
    for slot, gap in zip(order, gaps, strict=True):
        cursor += gap * dtype.itemsize
        addrs[slot] = cursor
        cursor += buffer_bytes
    return KvLayout(
        page_size=page_size,
        num_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        num_pages=num_pages,
        k_addrs=tuple(addrs[:layers]),
        v_addrs=tuple(addrs[layers:]),
    )


def space_size(layout: KvLayout) -> int:
    return max(layout.buffer_addrs) + layout.buffer_bytes


@st.composite
def page_pairs(draw: st.DrawFn, src: KvLayout, dst: KvLayout) -> tuple[list[int], list[int]]:
    count = draw(st.integers(0, min(src.num_pages, dst.num_pages)))
    # Sorted-with-shuffles lists make long consecutive runs likely, and breaks too.
    src_pages = draw(st.permutations(range(src.num_pages)).map(lambda p: sorted(p[:count])))
    dst_pages = draw(st.permutations(range(dst.num_pages)).map(lambda p: list(p[:count])))
    if draw(st.booleans()):
        dst_pages.sort()
    return src_pages, dst_pages


def apply(ops: tuple[WriteOp, ...], src: bytes, dst: bytearray) -> None:
    for op in ops:
        dst[op.dst_addr : op.dst_addr + op.length] = src[op.src_addr : op.src_addr + op.length]


def assert_disjoint(intervals: list[tuple[int, int]]) -> None:
    ordered = sorted(intervals)
    for (start, length), (next_start, _) in itertools.pairwise(ordered):
        assert start + length <= next_start, "two ops touch the same byte"


@EXAMPLES
@given(st.data(), geometries, st.integers(1, 3))
def test_page_plan_moves_every_page_byte_once(
    data: st.DataObject, geometry: Geometry, heads: int
) -> None:
    src = data.draw(layouts(heads=heads, geometry=geometry))
    dst = data.draw(layouts(heads=heads, geometry=geometry))
    src_pages, dst_pages = data.draw(page_pairs(src, dst))
    ops = plan_pages(src, dst, src_pages, dst_pages)

    expected_sources = sorted(
        (src.page_addr(b, page), src.item_len)
        for b in range(2 * src.num_layers)
        for page in src_pages
    )
    covered = sorted(
        (op.src_addr + k * src.item_len, src.item_len)
        for op in ops
        for k in range(op.length // src.item_len)
    )
    assert covered == expected_sources
    assert_disjoint([(op.dst_addr, op.length) for op in ops])

    runs = sum(
        1
        for i in range(len(src_pages))
        if i == 0 or (src_pages[i], dst_pages[i]) != (src_pages[i - 1] + 1, dst_pages[i - 1] + 1)
    )
    assert len(ops) == runs * 2 * src.num_layers

    source = random.Random(len(ops)).randbytes(space_size(src))
    target = bytearray(space_size(dst))
    apply(ops, source, target)
    for b in range(2 * src.num_layers):
        for s, d in zip(src_pages, dst_pages, strict=True):
            got = target[dst.page_addr(b, d) : dst.page_addr(b, d) + dst.item_len]
            assert got == source[src.page_addr(b, s) : src.page_addr(b, s) + src.item_len]


@EXAMPLES
@given(st.lists(st.integers(0, 100), max_size=40), st.integers(1, 9))
def test_split_batches_keeps_order_and_cap(lengths: list[int], cap: int) -> None:
    ops = tuple(WriteOp(i, 1000 + i, length) for i, length in enumerate(lengths))
    batches = split_batches(ops, cap)
    assert tuple(op for batch in batches for op in batch) == ops
    assert all(0 < len(batch) <= cap for batch in batches)
    assert all(len(batch) == cap for batch in batches[:-1])


def run_staged(
    plan_gather: StagedSlices,
    plan_scatter: StagedSlices,
    src: bytes,
    dst: bytearray,
    write: WriteOp,
) -> None:
    staging_src = bytearray(len(src) + plan_gather.region_bytes)
    staging_src[: len(src)] = src
    for buffer_addr, staging_addr in plan_gather.segments():
        staging_src[staging_addr : staging_addr + plan_gather.slice_bytes] = src[
            buffer_addr : buffer_addr + plan_gather.slice_bytes
        ]
    dst[write.dst_addr : write.dst_addr + write.length] = staging_src[
        write.src_addr : write.src_addr + write.length
    ]
    for buffer_addr, staging_addr in plan_scatter.segments():
        dst[buffer_addr : buffer_addr + plan_scatter.slice_bytes] = dst[
            staging_addr : staging_addr + plan_scatter.slice_bytes
        ]


@EXAMPLES
@given(
    st.data(),
    geometries,
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 8]),
)
def test_per_slice_and_staged_plans_agree(
    data: st.DataObject, geometry: Geometry, src_tp: int, dst_tp: int, total: int
) -> None:
    src_heads = rank_head_range(total, src_tp, data.draw(st.integers(0, src_tp - 1)))
    overlapping = [
        rank
        for rank in range(dst_tp)
        if rank_head_range(total, dst_tp, rank).intersect(src_heads) is not None
    ]
    dst_heads = rank_head_range(total, dst_tp, data.draw(st.sampled_from(overlapping)))
    src = data.draw(layouts(heads=src_heads.count, geometry=geometry))
    dst = data.draw(layouts(heads=dst_heads.count, geometry=geometry))
    src_pages, dst_pages = data.draw(page_pairs(src, dst))
    if not src_pages:
        src_pages, dst_pages = [0], [0]

    slices = plan_head_slices(src, dst, src_heads, dst_heads, src_pages, dst_pages)
    assert_disjoint([(op.src_addr, op.length) for op in slices])
    assert_disjoint([(op.dst_addr, op.length) for op in slices])
    shared = src_heads.intersect(dst_heads)
    assert shared is not None
    moved = 2 * src.num_layers * len(src_pages) * src.page_size * shared.count * src.head_bytes
    assert sum(op.length for op in slices) == moved

    rng = random.Random(moved)
    source = rng.randbytes(space_size(src))
    initial = rng.randbytes(space_size(dst))
    src_staging, dst_staging = len(source), len(initial)
    plan = plan_staged(
        src,
        dst,
        src_heads,
        dst_heads,
        src_pages,
        dst_pages,
        src_staging_addr=src_staging,
        dst_staging_addr=dst_staging,
    )
    assert plan.write.length == moved

    by_slices = bytearray(initial)
    apply(slices, source, by_slices)
    by_staging = bytearray(initial) + bytearray(plan.write.length)
    run_staged(plan.gather, plan.scatter, source, by_staging, plan.write)
    assert by_staging[:dst_staging] == by_slices
