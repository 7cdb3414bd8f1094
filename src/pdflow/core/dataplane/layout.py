"""Where KV and state bytes live: the per-rank KV layout and the non-KV state components.

A rank's KV cache is ``2 * num_layers`` buffers (K of every layer, then V of every layer, the
order SGLang registers its ``kv_data_ptrs`` in). Each buffer is an array of ``num_pages`` pages;
a page holds ``page_size`` tokens, a token holds ``num_heads`` heads of ``head_dim`` elements
(token-major, i.e. ``[page, token, head, dim]``). Everything here is plain arithmetic on integers
so planners and checkers can reason about bytes without touching memory.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

import msgspec

from pdflow.core.framework.errors import InvalidInput


class KvDtype(enum.Enum):
    """Element types a KV cache may hold. Only the item size matters to the data plane."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    KvDtype.FP32: 4,
    KvDtype.FP16: 2,
    KvDtype.BF16: 2,
    KvDtype.FP8_E4M3: 1,
    KvDtype.INT8: 1,
}


ADDRESS_SPACE = 1 << 64
"""Every buffer lies inside a 64-bit address space: a span past it is no memory at all (a
peer's layout that claims one would make the transport's engine raise instead of refuse)."""


def check_spans(what: str, spans: Sequence[tuple[int, int]]) -> None:
    """Each ``(addr, nbytes)`` is a buffer inside the 64-bit address space, or InvalidInput."""
    for addr, nbytes in spans:
        if addr < 0 or addr + nbytes > ADDRESS_SPACE:
            raise InvalidInput(
                f"{what} buffer [{addr:#x}, +{nbytes}) is outside the 64-bit address space; "
                "give addresses as unsigned pointers to registered memory"
            )


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise InvalidInput(f"{name} must be a positive integer, got {value}")


class HeadRange(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """The global KV heads ``[start, start + count)`` that one TP rank holds."""

    start: int
    count: int

    def __post_init__(self) -> None:
        if self.start < 0:
            raise InvalidInput(f"HeadRange.start must be >= 0, got {self.start}")
        _require_positive(count=self.count)

    @property
    def stop(self) -> int:
        return self.start + self.count

    def intersect(self, other: HeadRange) -> HeadRange | None:
        start, stop = max(self.start, other.start), min(self.stop, other.stop)
        return HeadRange(start, stop - start) if stop > start else None


def rank_head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The KV heads a rank holds: an even split, or one replicated head when TP > heads (GQA)."""
    _require_positive(total_kv_heads=total_kv_heads, tp_size=tp_size)
    if not 0 <= tp_rank < tp_size:
        raise InvalidInput(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise InvalidInput(
                f"{total_kv_heads} KV heads do not split evenly over TP={tp_size}; "
                "use a TP size that divides the head count"
            )
        per_rank = total_kv_heads // tp_size
        return HeadRange(tp_rank * per_rank, per_rank)
    if tp_size % total_kv_heads:
        raise InvalidInput(
            f"TP={tp_size} is not a multiple of {total_kv_heads} KV heads, so heads cannot be "
            "replicated evenly"
        )
    return HeadRange(tp_rank * total_kv_heads // tp_size, 1)


class KvLayout(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One rank's paged KV cache: geometry plus the base address of every K and V buffer."""

    page_size: int
    num_heads: int
    head_dim: int
    dtype: KvDtype
    num_pages: int
    k_addrs: tuple[int, ...]
    v_addrs: tuple[int, ...]

    def __post_init__(self) -> None:
        _require_positive(
            page_size=self.page_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_pages=self.num_pages,
            num_layers=len(self.k_addrs),
        )
        if len(self.k_addrs) != len(self.v_addrs):
            raise InvalidInput(
                f"KvLayout needs one V buffer per K buffer, got {len(self.k_addrs)} K and "
                f"{len(self.v_addrs)} V addresses"
            )
        check_spans("KvLayout", [(addr, self.buffer_bytes) for addr in self.buffer_addrs])
        spans = sorted(self.buffer_addrs)
        for lower, upper in itertools.pairwise(spans):
            if upper < lower + self.buffer_bytes:
                raise InvalidInput(
                    f"KvLayout buffers overlap: {lower:#x} and {upper:#x} are closer than one "
                    f"buffer ({self.buffer_bytes} bytes)"
                )

    @property
    def num_layers(self) -> int:
        return len(self.k_addrs)

    @property
    def buffer_addrs(self) -> tuple[int, ...]:
        """K of layers 0..L-1, then V of layers 0..L-1: the canonical buffer order."""
        return self.k_addrs + self.v_addrs

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        return self.num_heads * self.head_bytes

    @property
    def item_len(self) -> int:
        """Bytes of one page in one buffer."""
        return self.page_size * self.token_bytes

    @property
    def buffer_bytes(self) -> int:
        return self.num_pages * self.item_len

    def page_addr(self, buffer_index: int, page: int) -> int:
        return self.buffer_addrs[buffer_index] + page * self.item_len

    def check_pages(self, pages: Sequence[int], what: str) -> None:
        """Reject page ids outside this layout and pages listed twice."""
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise InvalidInput(f"{what} page {page} is outside [0, {self.num_pages})")
        if len(set(pages)) != len(pages):
            raise InvalidInput(f"{what} pages list a page twice; each page may be sent once")

    def same_page_format(self, other: KvLayout) -> bool:
        """True when a page of one layout is byte-for-byte a page of the other."""
        return (
            self.page_size == other.page_size
            and self.num_heads == other.num_heads
            and self.head_dim == other.head_dim
            and self.dtype == other.dtype
            and self.num_layers == other.num_layers
        )


def packed_layout(
    *,
    base_addr: int,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_heads: int,
    head_dim: int,
    dtype: KvDtype,
) -> KvLayout:
    """A layout whose buffers sit back to back from ``base_addr`` (K layers, then V layers)."""
    _require_positive(num_layers=num_layers)
    buffer_bytes = num_pages * page_size * num_heads * head_dim * dtype.itemsize
    addrs = tuple(base_addr + index * buffer_bytes for index in range(2 * num_layers))
    return KvLayout(
        page_size=page_size,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        num_pages=num_pages,
        k_addrs=addrs[:num_layers],
        v_addrs=addrs[num_layers:],
    )


def kv_to_page_indices(kv_indices: Sequence[int], page_size: int) -> tuple[int, ...]:
    """Page ids of a token-slot list whose pages are all full except possibly the last.

    Every run of ``page_size`` slots must start on a page boundary and be consecutive; that is
    what makes ``slots[::page_size] // page_size`` exact, so it is checked, not assumed.
    """
    _require_positive(page_size=page_size)
    pages = []
    for start in range(0, len(kv_indices), page_size):
        group = kv_indices[start : start + page_size]
        first = group[0]
        if first < 0 or first % page_size:
            raise InvalidInput(
                f"token slot {first} at position {start} does not start a page of {page_size}"
            )
        for offset, slot in enumerate(group):
            if slot != first + offset:
                raise InvalidInput(
                    f"token slots of page {first // page_size} are not consecutive at position "
                    f"{start + offset} (got {slot}, expected {first + offset})"
                )
        pages.append(first // page_size)
    return tuple(pages)


class MambaSlot(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, tag=True):
    """A recurrent-state model's single per-request state slot."""

    slot: int

    def __post_init__(self) -> None:
        if self.slot < 0:
            raise InvalidInput(f"MambaSlot.slot must be >= 0, got {self.slot}")

    def indices(self) -> tuple[int, ...]:
        return (self.slot,)


def swa_window_start(prefix_len: int, seq_len: int, window: int, page_size: int) -> int:
    """First token a sliding-window layer still needs, rounded down to its page."""
    _require_positive(window=window, page_size=page_size)
    if not 0 <= prefix_len <= seq_len:
        raise InvalidInput(f"need 0 <= prefix_len ({prefix_len}) <= seq_len ({seq_len})")
    start = max(prefix_len, seq_len - window)
    return start - start % page_size


class SwaWindow(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, tag=True):
    """The SWA-pool pages covering a sequence's live window, from ``start_token`` on."""

    start_token: int
    pages: tuple[int, ...]

    @classmethod
    def derive(
        cls,
        swa_slots: Sequence[int],
        *,
        prefix_len: int,
        window: int,
        page_size: int,
    ) -> SwaWindow:
        """Window of a sequence given its SWA-pool slot for every token (``len`` = seq_len)."""
        start = swa_window_start(prefix_len, len(swa_slots), window, page_size)
        return cls(start, kv_to_page_indices(swa_slots[start:], page_size))

    def indices(self) -> tuple[int, ...]:
        return self.pages


class AuxRow(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, tag=True):
    """One metadata-buffer row (first token, logprobs, ...) of ``row_bytes`` bytes."""

    row: int
    row_bytes: int

    def __post_init__(self) -> None:
        if self.row < 0:
            raise InvalidInput(f"AuxRow.row must be >= 0, got {self.row}")
        _require_positive(row_bytes=self.row_bytes)

    def indices(self) -> tuple[int, ...]:
        return (self.row,)


class AuxBuffer(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """An engine's aux (metadata) buffers, indexed alike: buffer ``b`` holds ``num_rows`` items
    of ``item_lens[b]`` bytes from ``addrs[b]`` (SGLang's ``aux_data_ptrs`` / ``aux_item_lens``:
    output ids, logprobs, the bootstrap room, ...).

    A request owns one index; its aux row is the concatenation of its item in every buffer, in
    buffer order: what the decode needs before it may run the request.
    """

    addrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    num_rows: int

    def __post_init__(self) -> None:
        if not self.addrs or len(self.addrs) != len(self.item_lens):
            raise InvalidInput(
                f"AuxBuffer needs one item length per buffer, got {len(self.addrs)} addresses "
                f"and {len(self.item_lens)} item lengths"
            )
        _require_positive(num_rows=self.num_rows)
        for length in self.item_lens:
            _require_positive(item_len=length)
        rows = zip(self.addrs, self.item_lens, strict=True)
        check_spans("AuxBuffer", [(addr, length * self.num_rows) for addr, length in rows])

    @classmethod
    def single(cls, base_addr: int, row_bytes: int, num_rows: int) -> AuxBuffer:
        """One buffer of ``num_rows`` rows of ``row_bytes``."""
        return cls((base_addr,), (row_bytes,), num_rows)

    @property
    def row_bytes(self) -> int:
        return sum(self.item_lens)

    def row(self, index: int) -> AuxRow:
        """The row ``index``, refused with a clear error when it is outside the buffers."""
        if not 0 <= index < self.num_rows:
            raise InvalidInput(
                f"aux index {index} is outside this rank's aux buffers [0, {self.num_rows})"
            )
        return AuxRow(index, self.row_bytes)

    def row_ranges(self, index: int) -> tuple[tuple[int, int], ...]:
        """``(address, length)`` of the row's item in every buffer, in buffer order."""
        row = self.row(index).row
        return tuple(
            (addr + row * length, length)
            for addr, length in zip(self.addrs, self.item_lens, strict=True)
        )


class StateKind(enum.Enum):
    """What a model-state component is; it decides how an engine derives a request's indices."""

    MAMBA = "mamba"
    """One recurrent-state slot per request (``MambaSlot``): conv and SSM states, say."""
    SWA = "swa"
    """Sliding-window KV pages from the window start on (``SwaWindow.derive``)."""
    BLOB = "blob"
    """One opaque per-request item the model needs (``MambaSlot`` indexing, any bytes)."""


class StateBuffers(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One model-state component's memory, SGLang's ``state_data_ptrs`` of one state type:
    buffer ``b`` holds ``num_items`` items of ``item_lens[b]`` bytes from ``addrs[b]``, all
    indexed alike (a Mamba slot is an item in the conv buffer and one in the SSM buffer).

    Across TP sizes a buffer is split like KV: ``total_heads[b]`` heads over all TP ranks (1,
    the default: every rank holds the item whole, e.g. a blob), and an item is ``tokens``
    token-major rows of this rank's heads (``[token, head, ...]``: an SWA page has ``tokens`` =
    page size; a Mamba SSM state ``[head, ...]`` has 1)."""

    kind: StateKind
    addrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    num_items: int
    total_heads: tuple[int, ...] = ()
    """Heads of each buffer over all TP ranks; empty: every buffer replicated (1)."""
    tokens: int = 1

    def __post_init__(self) -> None:
        if not self.addrs or len(self.addrs) != len(self.item_lens):
            raise InvalidInput(
                f"StateBuffers needs one item length per buffer, got {len(self.addrs)} "
                f"addresses and {len(self.item_lens)} item lengths"
            )
        _require_positive(num_items=self.num_items, tokens=self.tokens)
        for length in self.item_lens:
            _require_positive(item_len=length)
        items = zip(self.addrs, self.item_lens, strict=True)
        check_spans("StateBuffers", [(addr, length * self.num_items) for addr, length in items])
        if self.total_heads and len(self.total_heads) != len(self.addrs):
            raise InvalidInput(
                f"StateBuffers needs one total_heads per buffer (or none), got "
                f"{len(self.total_heads)} for {len(self.addrs)} buffers"
            )
        for heads in self.total_heads:
            _require_positive(total_heads=heads)

    @property
    def heads_per_buffer(self) -> tuple[int, ...]:
        return self.total_heads or (1,) * len(self.addrs)

    def check_indices(self, indices: Sequence[int], what: str) -> None:
        for index in indices:
            if not 0 <= index < self.num_items:
                raise InvalidInput(
                    f"{what} {self.kind.value} state index {index} is outside [0, {self.num_items})"
                )

    def same_split(self, other: StateBuffers) -> bool:
        """True when both describe the same component (each rank's item sizes follow its TP)."""
        return (self.kind, len(self.addrs), self.heads_per_buffer, self.tokens) == (
            other.kind, len(other.addrs), other.heads_per_buffer, other.tokens)  # fmt: skip

    def item_addr(self, buffer: int, index: int) -> int:
        return self.addrs[buffer] + index * self.item_lens[buffer]


class FullSequencePages(
    msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True, tag=True
):
    """Per-page state covering the whole sequence (DSA indexer keys, block scales, ...)."""

    pages: tuple[int, ...]

    @classmethod
    def derive(cls, slots: Sequence[int], *, page_size: int) -> FullSequencePages:
        return cls(kv_to_page_indices(slots, page_size))

    def indices(self) -> tuple[int, ...]:
        return self.pages


StateComponent = MambaSlot | SwaWindow | AuxRow | FullSequencePages
