import pytest

from pdflow.core.dataplane.layout import HeadRange, KvDtype, KvLayout, packed_layout
from pdflow.core.dataplane.planning import (
    PageChunk,
    WriteOp,
    destination_ranges,
    pages_after_prefix,
    partition_chunks,
    plan_head_slices,
    plan_pages,
    plan_staged,
    source_ranges,
    split_batches,
    total_bytes,
)
from pdflow.core.framework.errors import InvalidInput


def layout_at(base: int, *, heads: int = 2, layers: int = 1, pages: int = 8) -> KvLayout:
    return packed_layout(
        base_addr=base,
        num_layers=layers,
        num_pages=pages,
        page_size=2,
        num_heads=heads,
        head_dim=4,
        dtype=KvDtype.FP16,
    )


def test_plan_pages_coalesces_runs_consecutive_on_both_sides() -> None:
    src, dst = layout_at(0), layout_at(100_000)
    item = src.item_len  # 32 bytes
    ops = plan_pages(src, dst, [1, 2, 3, 5, 6], [4, 5, 7, 0, 1])
    # Runs: (1,4)+(2,5); (3,7) breaks on dst; (5,0)+(6,1). Buffers: K then V.
    expected_k = [
        WriteOp(1 * item, 100_000 + 4 * item, 2 * item),
        WriteOp(3 * item, 100_000 + 7 * item, item),
        WriteOp(5 * item, 100_000 + 0 * item, 2 * item),
    ]
    v_shift = src.buffer_bytes
    expected_v = [
        WriteOp(op.src_addr + v_shift, op.dst_addr + v_shift, op.length) for op in expected_k
    ]
    assert ops == tuple(expected_k + expected_v)
    assert total_bytes(ops) == 2 * 5 * item


def test_plan_pages_rejects_mismatches() -> None:
    src = layout_at(0)
    with pytest.raises(InvalidInput, match="differ in format"):
        plan_pages(src, layout_at(100_000, heads=4), [0], [0])
    with pytest.raises(InvalidInput, match="truncate"):
        plan_pages(src, layout_at(100_000), [0, 1], [0])
    with pytest.raises(InvalidInput, match="destination page 9"):
        plan_pages(src, layout_at(100_000), [0], [9])
    with pytest.raises(InvalidInput, match="twice"):
        plan_pages(src, layout_at(100_000), [0, 1], [3, 3])


def test_ranges_follow_op_order() -> None:
    ops = (WriteOp(10, 20, 3), WriteOp(0, 50, 2))
    assert source_ranges(ops) == ((10, 3), (0, 2))
    assert destination_ranges(ops) == ((20, 3), (50, 2))


def test_pages_after_prefix() -> None:
    assert pages_after_prefix(100, 0, 16) == range(0, 7)
    assert pages_after_prefix(100, 32, 16) == range(2, 7)
    assert pages_after_prefix(96, 96, 16) == range(6, 6)
    with pytest.raises(InvalidInput, match="page boundary"):
        pages_after_prefix(100, 10, 16)
    with pytest.raises(InvalidInput, match="must lie in"):
        pages_after_prefix(10, 16, 16)


def test_partition_chunks_truncates_non_last_chunks_to_pages() -> None:
    assert partition_chunks(100, 16, 40, decode_prefix_len=16) == (
        PageChunk(0, 2, False),
        PageChunk(2, 4, False),
        PageChunk(4, 6, True),
    )
    assert partition_chunks(32, 16, 64) == (PageChunk(0, 2, True),)


def test_partition_chunks_sends_one_empty_last_chunk_when_all_is_cached() -> None:
    assert partition_chunks(32, 16, 16, decode_prefix_len=32) == (PageChunk(0, 0, True),)


def test_partition_chunks_needs_room_for_a_page() -> None:
    with pytest.raises(InvalidInput, match="never make progress"):
        partition_chunks(100, 16, 8)


def test_split_batches() -> None:
    ops = tuple(WriteOp(i, i, 1) for i in range(5))
    assert split_batches(ops, 2) == (ops[0:2], ops[2:4], ops[4:5])
    assert split_batches((), 3) == ()
    with pytest.raises(InvalidInput, match="positive"):
        split_batches(ops, 0)


def test_head_slices_for_tp2_to_tp1() -> None:
    src = layout_at(0, heads=1)  # prefill rank 1 of TP=2: global head 1
    dst = layout_at(100_000, heads=2)
    ops = plan_head_slices(src, dst, HeadRange(1, 1), HeadRange(0, 2), [3], [5])
    # 2 buffers x 1 page x 2 tokens, 8 bytes each, landing on head 1 of each decode token.
    assert len(ops) == 4
    assert ops[1] == WriteOp(
        3 * src.item_len + src.token_bytes, 100_000 + 5 * dst.item_len + dst.token_bytes + 8, 8
    )


def test_head_slices_reject_disjoint_heads_and_wrong_counts() -> None:
    src, dst = layout_at(0, heads=1), layout_at(100_000, heads=1)
    with pytest.raises(InvalidInput, match="share nothing"):
        plan_head_slices(src, dst, HeadRange(0, 1), HeadRange(1, 1), [0], [0])
    with pytest.raises(InvalidInput, match="HeadRange has 2"):
        plan_head_slices(src, dst, HeadRange(0, 2), HeadRange(0, 1), [0], [0])


def test_staged_plan_is_one_bulk_write_of_the_region() -> None:
    src = layout_at(0, heads=1, layers=2)
    dst = layout_at(100_000, heads=2, layers=2)
    plan = plan_staged(
        src,
        dst,
        HeadRange(1, 1),
        HeadRange(0, 2),
        [3, 4],
        [5, 1],
        src_staging_addr=50_000,
        dst_staging_addr=200_000,
    )
    region = 4 * 2 * 2 * 8  # buffers x pages x tokens x slice bytes
    assert plan.write == WriteOp(50_000, 200_000, region)
    assert plan.gather.region_bytes == plan.scatter.region_bytes == region
    assert plan.scatter.slice_offset == 8 and plan.gather.slice_offset == 0
    slices = plan_head_slices(src, dst, HeadRange(1, 1), HeadRange(0, 2), [3, 4], [5, 1])
    assert tuple(plan.gather.buffer_ranges()) == source_ranges(slices)
    assert tuple(plan.scatter.buffer_ranges()) == destination_ranges(slices)
    with pytest.raises(InvalidInput, match="nothing to stage"):
        plan_staged(
            src,
            dst,
            HeadRange(1, 1),
            HeadRange(0, 2),
            [],
            [],
            src_staging_addr=0,
            dst_staging_addr=0,
        )
