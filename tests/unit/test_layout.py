import msgspec
import pytest

from pdflow.core.dataplane.layout import (
    AuxRow,
    FullSequencePages,
    HeadRange,
    KvDtype,
    KvLayout,
    MambaSlot,
    StateComponent,
    SwaWindow,
    kv_to_page_indices,
    packed_layout,
    rank_head_range,
    swa_window_start,
)
from pdflow.core.framework.errors import InvalidInput


def small_layout(**overrides: object) -> KvLayout:
    fields: dict[str, object] = {
        "page_size": 4,
        "num_heads": 2,
        "head_dim": 8,
        "dtype": KvDtype.FP16,
        "num_pages": 3,
        "k_addrs": (0, 1000),
        "v_addrs": (2000, 3000),
    }
    fields.update(overrides)
    return KvLayout(**fields)  # type: ignore[arg-type]


def test_dtype_itemsizes() -> None:
    sizes = {dtype: dtype.itemsize for dtype in KvDtype}
    assert sizes == {
        KvDtype.FP32: 4,
        KvDtype.FP16: 2,
        KvDtype.BF16: 2,
        KvDtype.FP8_E4M3: 1,
        KvDtype.INT8: 1,
    }


def test_layout_derived_sizes_and_buffer_order() -> None:
    layout = small_layout()
    assert layout.num_layers == 2
    assert layout.head_bytes == 16
    assert layout.token_bytes == 32
    assert layout.item_len == 128
    assert layout.buffer_bytes == 384
    assert layout.buffer_addrs == (0, 1000, 2000, 3000)
    assert layout.page_addr(2, 1) == 2128


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"page_size": 0}, "page_size must be a positive"),
        ({"num_heads": -1}, "num_heads must be a positive"),
        ({"k_addrs": (), "v_addrs": ()}, "num_layers must be a positive"),
        ({"v_addrs": (2000,)}, "one V buffer per K buffer"),
        ({"k_addrs": (0, 100)}, "buffers overlap"),
        ({"k_addrs": (-8, 1000)}, "outside the 64-bit address space"),
        ({"k_addrs": ((1 << 64) - 64, 1000)}, "outside the 64-bit address space"),
    ],
)
def test_layout_rejects_bad_geometry(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        small_layout(**overrides)


def test_packed_layout_places_buffers_back_to_back() -> None:
    layout = packed_layout(
        base_addr=64,
        num_layers=2,
        num_pages=3,
        page_size=4,
        num_heads=2,
        head_dim=8,
        dtype=KvDtype.BF16,
    )
    assert layout.buffer_addrs == (64, 448, 832, 1216)


def test_check_pages_reports_range_and_duplicates() -> None:
    layout = small_layout()
    layout.check_pages([0, 2], "source")
    with pytest.raises(InvalidInput, match="source page 3 is outside"):
        layout.check_pages([3], "source")
    with pytest.raises(InvalidInput, match="twice"):
        layout.check_pages([1, 1], "destination")


@pytest.mark.parametrize(
    ("total", "tp", "rank", "expected"),
    [
        (8, 1, 0, HeadRange(0, 8)),
        (8, 4, 3, HeadRange(6, 2)),
        (8, 8, 5, HeadRange(5, 1)),
        (2, 8, 5, HeadRange(1, 1)),
    ],
)
def test_rank_head_range(total: int, tp: int, rank: int, expected: HeadRange) -> None:
    assert rank_head_range(total, tp, rank) == expected


@pytest.mark.parametrize(
    ("total", "tp", "rank", "message"),
    [(8, 3, 0, "split evenly"), (3, 4, 0, "not a multiple"), (8, 2, 2, "outside")],
)
def test_rank_head_range_rejects(total: int, tp: int, rank: int, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        rank_head_range(total, tp, rank)


def test_head_range_intersection() -> None:
    assert HeadRange(0, 4).intersect(HeadRange(2, 4)) == HeadRange(2, 2)
    assert HeadRange(0, 2).intersect(HeadRange(2, 2)) is None


def test_kv_to_page_indices() -> None:
    assert kv_to_page_indices([5, 9, 2], 1) == (5, 9, 2)
    assert kv_to_page_indices([8, 9, 10, 11, 4, 5], 4) == (2, 1)
    assert kv_to_page_indices([], 4) == ()


@pytest.mark.parametrize(
    ("slots", "message"),
    [([1, 2, 3, 4], "does not start a page"), ([4, 5, 7, 8], "not consecutive")],
)
def test_kv_to_page_indices_rejects_broken_pages(slots: list[int], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        kv_to_page_indices(slots, 4)


def test_swa_window_start_rounds_down_to_page() -> None:
    assert swa_window_start(prefix_len=0, seq_len=100, window=30, page_size=16) == 64
    assert swa_window_start(prefix_len=80, seq_len=100, window=30, page_size=16) == 80
    assert swa_window_start(prefix_len=0, seq_len=10, window=30, page_size=4) == 0
    with pytest.raises(InvalidInput, match="prefix_len"):
        swa_window_start(prefix_len=11, seq_len=10, window=4, page_size=4)


def test_swa_window_derives_pages_of_the_window() -> None:
    # 12 tokens in SWA pages 7, 3, 5 (page size 4); window of 5 starts at token 7 -> page 4.
    slots = [28, 29, 30, 31, 12, 13, 14, 15, 20, 21, 22, 23]
    window = SwaWindow.derive(slots, prefix_len=0, window=5, page_size=4)
    assert window == SwaWindow(start_token=4, pages=(3, 5))
    assert window.indices() == (3, 5)


def test_other_state_components() -> None:
    assert MambaSlot(3).indices() == (3,)
    assert AuxRow(row=2, row_bytes=64).indices() == (2,)
    assert FullSequencePages.derive([4, 5, 0, 1], page_size=2).indices() == (2, 0)
    with pytest.raises(InvalidInput, match="slot"):
        MambaSlot(-1)
    with pytest.raises(InvalidInput, match="row_bytes"):
        AuxRow(row=0, row_bytes=0)


def test_state_components_round_trip_as_a_tagged_union() -> None:
    parts: list[StateComponent] = [
        MambaSlot(1),
        SwaWindow(8, (2, 3)),
        AuxRow(4, 128),
        FullSequencePages((0, 1)),
    ]
    encoded = msgspec.msgpack.encode(parts)
    assert msgspec.msgpack.decode(encoded, type=list[StateComponent]) == parts


def test_buffers_past_the_address_space_are_refused_where_they_are_described() -> None:
    """A peer's layout names the destination of writes: a span past 2**64 is refused when the
    layout is decoded, not found by the engine in the middle of a call."""
    from pdflow.core.dataplane.buffers import KvBuffer
    from pdflow.core.dataplane.layout import AuxBuffer, StateBuffers, StateKind

    top = (1 << 64) - 4096
    with pytest.raises(InvalidInput, match="outside the 64-bit address space"):
        KvBuffer(addr=top, length=8192, item_len=4096, layer=0)
    with pytest.raises(InvalidInput, match="outside the 64-bit address space"):
        AuxBuffer(addrs=(top,), item_lens=(64,), num_rows=128)
    with pytest.raises(InvalidInput, match="outside the 64-bit address space"):
        StateBuffers(kind=StateKind.MAMBA, addrs=(top,), item_lens=(4096,), num_items=2)
    KvBuffer(addr=top, length=4096, item_len=4096, layer=0)  # the last page of memory is fine
