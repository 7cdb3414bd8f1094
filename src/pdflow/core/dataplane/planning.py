"""Transfer planning: from page lists and layouts to the byte writes a transport performs.

A plan is data. ``WriteOp(src_addr, dst_addr, length)`` asks the transport to copy ``length``
bytes from local address ``src_addr`` to remote address ``dst_addr``. An engine's own buffer
description (:class:`~pdflow.core.dataplane.buffers.KvBuffers`) is planned by
:func:`plan_buffers`, which picks per tensor which of the shapes below applies (whole pages,
head slices, or a replicated tensor from one writer); the classic :class:`KvLayout` functions are
the same pairing (:func:`plan_slice_pairs`) over K and V buffers. Three plan shapes exist:

* **Equal page format** (same TP, or MLA): :func:`plan_pages` writes whole pages, one op per run
  of pages that are consecutive on *both* sides, per buffer.
* **Heterogeneous TP, per slice** (:func:`plan_head_slices`): pages are token-major, so the head
  slice one prefill rank owns inside a decode page is ``page_size`` separate pieces. One op per
  (buffer, page, token): the many-small-writes baseline.
* **Heterogeneous TP, staged** (:func:`plan_staged`): the prefill gathers its slices into a
  contiguous staging region, ONE op moves the region into the decode's staging ring, and the
  decode scatters it into its pages.

Staging region byte layout (both sides derive it from :class:`StagedSlices`, so they agree)::

    region = concat over buffer b in canonical order (K of layers 0..L-1, then V of 0..L-1)
               concat over chunk page i in list order
                 concat over token t in 0..page_size-1
                   the slice_bytes bytes of that token's shared heads

    offset(b, i, t) = ((b * num_pages + i) * page_size + t) * slice_bytes
    region_bytes    = 2 * num_layers * num_pages * page_size * slice_bytes

The gather reads slice (b, i, t) at ``buffer_addrs[b] + pages[i] * item_len + t * token_bytes +
slice_offset`` and the scatter writes it at the same expression over the decode's layout. When
``k`` prefill ranks feed one decode rank, the decode's staging slot for a chunk holds their
regions back to back in prefill-rank order (``region_bytes * j`` for the j-th rank).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgspec

from pdflow.core.dataplane.buffers import (
    BufferSlice,
    KvBuffers,
    PageOrder,
    TpPlace,
    destination_slices,
    exchanged_slices,
    page_slice,
)
from pdflow.core.dataplane.checksum import ByteRange
from pdflow.core.dataplane.layout import HeadRange, KvLayout, kv_to_page_indices
from pdflow.core.framework.errors import InvalidInput

__all__ = [
    "PageChunk",
    "SlicePairs",
    "StagedSlices",
    "StagingPlan",
    "WriteOp",
    "buffer_slice_pairs",
    "destination_ranges",
    "kv_to_page_indices",
    "pages_after_prefix",
    "partition_chunks",
    "plan_buffers",
    "plan_head_slices",
    "plan_pages",
    "plan_slice_pairs",
    "plan_staged",
    "source_ranges",
    "split_batches",
    "total_bytes",
    "widest_word",
]


class WriteOp(msgspec.Struct, frozen=True, array_like=True):
    """Copy ``length`` bytes from local ``src_addr`` to remote ``dst_addr``."""

    src_addr: int
    dst_addr: int
    length: int


def total_bytes(ops: Sequence[WriteOp]) -> int:
    return sum(op.length for op in ops)


def widest_word(values: Iterable[int]) -> int:
    """The widest machine word (8, 4, 2 or 1 bytes) dividing every address and size given.

    Copying in such words moves the same bytes as copying bytes, only faster.
    """
    common = 8
    for value in values:
        while value % common:
            common //= 2
    return common


def source_ranges(ops: Sequence[WriteOp]) -> tuple[ByteRange, ...]:
    """What the prefill read, in op order: the ranges its end-to-end checksum covers."""
    return tuple((op.src_addr, op.length) for op in ops)


def destination_ranges(ops: Sequence[WriteOp]) -> tuple[ByteRange, ...]:
    """Where those bytes landed, in the same order: what the decode checksums."""
    return tuple((op.dst_addr, op.length) for op in ops)


class PageChunk(msgspec.Struct, frozen=True):
    """Page positions ``[start, stop)`` of a request's send range that one chunk carries."""

    start: int
    stop: int
    is_last: bool

    @property
    def num_pages(self) -> int:
        return self.stop - self.start


def pages_after_prefix(num_tokens: int, decode_prefix_len: int, page_size: int) -> range:
    """Page positions of a sequence the prefill must send when the decode holds a prefix."""
    if page_size <= 0:
        raise InvalidInput(f"page_size must be positive, got {page_size}")
    if not 0 <= decode_prefix_len <= num_tokens:
        raise InvalidInput(
            f"decode_prefix_len {decode_prefix_len} must lie in [0, num_tokens={num_tokens}]"
        )
    if decode_prefix_len % page_size:
        raise InvalidInput(
            f"decode_prefix_len {decode_prefix_len} is not a multiple of page_size {page_size}; "
            "a cached prefix always ends on a page boundary"
        )
    return range(decode_prefix_len // page_size, -(-num_tokens // page_size))


def partition_chunks(
    num_tokens: int, page_size: int, chunk_tokens: int, decode_prefix_len: int = 0
) -> tuple[PageChunk, ...]:
    """Split the tokens after the decode's prefix into chunks of at most ``chunk_tokens``.

    Non-last chunks end on a page boundary (a partial page travels with the next chunk), so the
    chunks partition the send range's page positions ``[0, num_pages)`` and exactly one chunk,
    the final one, is last. A request with nothing to send still yields one empty last chunk.
    """
    send = pages_after_prefix(num_tokens, decode_prefix_len, page_size)
    if chunk_tokens < page_size:
        raise InvalidInput(
            f"chunk_tokens {chunk_tokens} is smaller than a page ({page_size}); chunks could "
            "never make progress"
        )
    first_page = send.start
    chunks: list[PageChunk] = []
    token = decode_prefix_len
    while True:
        end = min(token + chunk_tokens, num_tokens)
        if end == num_tokens:
            chunks.append(PageChunk(token // page_size - first_page, len(send), True))
            return tuple(chunks)
        end -= end % page_size
        chunks.append(
            PageChunk(token // page_size - first_page, end // page_size - first_page, False)
        )
        token = end


def _check_page_pairs(
    src_layout: KvLayout, dst_layout: KvLayout, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> None:
    if len(src_pages) != len(dst_pages):
        raise InvalidInput(
            f"{len(src_pages)} source pages but {len(dst_pages)} destination pages; truncate to "
            "the shorter list before planning"
        )
    if src_layout.num_layers != dst_layout.num_layers:
        raise InvalidInput(
            f"source has {src_layout.num_layers} layers, destination {dst_layout.num_layers}"
        )
    src_layout.check_pages(src_pages, "source")
    dst_layout.check_pages(dst_pages, "destination")


def _page_runs(src_pages: Sequence[int],
               dst_pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:  # fmt: skip
    """Maximal ``(src_start, dst_start, length)`` runs consecutive on both sides."""
    index = 0
    while index < len(src_pages):
        length = 1
        while (
            index + length < len(src_pages)
            and src_pages[index + length] == src_pages[index] + length
            and dst_pages[index + length] == dst_pages[index] + length
        ):
            length += 1
        yield src_pages[index], dst_pages[index], length
        index += length


def plan_slice_pairs(pairs: Sequence[tuple[BufferSlice, BufferSlice]], src_pages: Sequence[int],
                     dst_pages: Sequence[int]) -> tuple[WriteOp, ...]:  # fmt: skip
    """The writes moving each source slice onto its destination slice, buffer by buffer: one
    per run of pages consecutive on both sides when both hold the pages whole, else one per
    (page, piece)."""
    if len(src_pages) != len(dst_pages):
        raise InvalidInput(
            f"{len(src_pages)} source pages but {len(dst_pages)} destination pages; truncate to "
            "the shorter list before planning"
        )
    ops: list[WriteOp] = []
    runs: list[tuple[int, int, int]] | None = None  # the same for every buffer: found once
    for mine, theirs in pairs:
        a, b = mine.slice, theirs.slice
        if (a.pieces, a.nbytes) != (b.pieces, b.nbytes):
            raise InvalidInput("the two sides slice a page differently; cannot pair the bytes")
        if a.nbytes == mine.item_len and b.nbytes == theirs.item_len:
            if runs is None:
                runs = list(_page_runs(src_pages, dst_pages))
            src_base, dst_base, item = mine.addr, theirs.addr, mine.item_len
            dst_item = theirs.item_len
            ops += [WriteOp(src_base + s * item, dst_base + d * dst_item, count * item)
                    for s, d, count in runs]  # fmt: skip
            continue
        for s, d in zip(src_pages, dst_pages, strict=True):
            ops += [WriteOp(src_addr, dst_addr, length)
                    for (src_addr, length), (dst_addr, _) in zip(mine.ranges(s), theirs.ranges(d),
                                                                 strict=True)]  # fmt: skip
    return tuple(ops)


SlicePairs = tuple[tuple[BufferSlice, BufferSlice], ...]


def buffer_slice_pairs(src: KvBuffers, src_tp: TpPlace, dst: KvBuffers, dst_tp: TpPlace,
                       stage: bool = False) -> SlicePairs:  # fmt: skip
    """Each source slice the source rank writes with the destination slice it lands on: the
    tensors it writes under the TP rule (:func:`~pdflow.core.dataplane.buffers.shared_heads`),
    in the destination's buffer order; ``stage``: the source is one pipeline stage and writes
    only the tensors (layers) it holds. Depends on the two layouts only, never on the pages,
    so a shell may keep it per peer layout."""
    mine = exchanged_slices(src, True, src_tp, dst_tp, dst, stage)
    theirs = {found.index: found for found in destination_slices(dst, src_tp, dst_tp)}
    return tuple((m, theirs[m.index]) for m in mine)


def plan_buffers(
    src: KvBuffers,
    src_tp: TpPlace,
    dst: KvBuffers,
    dst_tp: TpPlace,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    stage: bool = False,
    pairs: SlicePairs | None = None,
) -> tuple[WriteOp, ...]:
    """Every write the source rank makes into the destination rank for these page pairs
    (:func:`buffer_slice_pairs`, or ``pairs`` when the caller kept them for these layouts)."""
    src.check_pages(src_pages, "source")
    dst.check_pages(dst_pages, "destination")
    if pairs is None:
        pairs = buffer_slice_pairs(src, src_tp, dst, dst_tp, stage)
    return plan_slice_pairs(pairs, src_pages, dst_pages)


def _layout_slices(layout: KvLayout, own: HeadRange, shared: HeadRange,
                   whole: bool) -> tuple[BufferSlice, ...]:  # fmt: skip
    cut = page_slice(layout.item_len, PageOrder.NHD, layout.page_size, layout.head_bytes, own,
                     shared, whole)  # fmt: skip
    return tuple(BufferSlice(index, addr, layout.item_len, cut, (0, 0, ""))
                 for index, addr in enumerate(layout.buffer_addrs))  # fmt: skip


def plan_pages(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> tuple[WriteOp, ...]:
    """Whole-page writes, coalesced per buffer over runs consecutive on both sides."""
    if not src_layout.same_page_format(dst_layout):
        raise InvalidInput(
            "source and destination pages differ in format (page size, heads, head_dim, dtype or "
            "layers); use plan_head_slices or plan_staged for heterogeneous TP"
        )
    _check_page_pairs(src_layout, dst_layout, src_pages, dst_pages)
    heads = HeadRange(0, src_layout.num_heads)
    return plan_slice_pairs(
        list(zip(_layout_slices(src_layout, heads, heads, True),
                 _layout_slices(dst_layout, heads, heads, True), strict=True)),
        src_pages, dst_pages,
    )  # fmt: skip


class _SliceGeometry(msgspec.Struct, frozen=True):
    src_offset: int
    dst_offset: int
    slice_bytes: int


def _slice_geometry(
    src_layout: KvLayout, dst_layout: KvLayout, src_heads: HeadRange, dst_heads: HeadRange
) -> HeadRange:
    if (src_layout.page_size, src_layout.head_dim, src_layout.dtype) != (
        dst_layout.page_size,
        dst_layout.head_dim,
        dst_layout.dtype,
    ):
        raise InvalidInput(
            "head-slice transfer needs equal page_size, head_dim and dtype on both sides"
        )
    for side, layout, heads in (
        ("source", src_layout, src_heads),
        ("destination", dst_layout, dst_heads),
    ):
        if layout.num_heads != heads.count:
            raise InvalidInput(
                f"{side} layout holds {layout.num_heads} heads but its HeadRange has {heads.count}"
            )
    shared = src_heads.intersect(dst_heads)
    if shared is None:
        raise InvalidInput(
            f"source heads {src_heads} and destination heads {dst_heads} share nothing; this "
            "rank pair exchanges no KV"
        )
    return shared


def plan_head_slices(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    src_heads: HeadRange,
    dst_heads: HeadRange,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> tuple[WriteOp, ...]:
    """One write per (buffer, page, token) of the heads both ranks hold: the baseline."""
    shared = _slice_geometry(src_layout, dst_layout, src_heads, dst_heads)
    _check_page_pairs(src_layout, dst_layout, src_pages, dst_pages)
    return plan_slice_pairs(
        list(zip(_layout_slices(src_layout, src_heads, shared, False),
                 _layout_slices(dst_layout, dst_heads, shared, False), strict=True)),
        src_pages, dst_pages,
    )  # fmt: skip


class StagedSlices(msgspec.Struct, frozen=True):
    """Equal-size slices, one per (buffer, page, token), packed into a staging region.

    Read it as a gather (buffers to staging) on the prefill and as a scatter (staging to
    buffers) on the decode; the module docstring fixes the region's byte layout.
    """

    buffer_addrs: tuple[int, ...]
    pages: tuple[int, ...]
    page_size: int
    item_len: int
    token_bytes: int
    slice_offset: int
    slice_bytes: int
    staging_addr: int

    @property
    def region_bytes(self) -> int:
        return len(self.buffer_addrs) * len(self.pages) * self.page_size * self.slice_bytes

    @property
    def word_bytes(self) -> int:
        """Widest word every address, stride and slice of this set is a multiple of."""
        return widest_word(
            (
                *self.buffer_addrs,
                self.staging_addr,
                self.item_len,
                self.token_bytes,
                self.slice_offset,
                self.slice_bytes,
            )
        )

    def buffer_ranges(self) -> Iterator[ByteRange]:
        """The slices in staging order; equal to the per-slice plan's ranges on this side."""
        for buffer_addr, _ in self.segments():
            yield buffer_addr, self.slice_bytes

    def segments(self) -> Iterator[tuple[int, int]]:
        """``(buffer_addr, staging_addr)`` of every slice, in staging order."""
        staging = self.staging_addr
        for base in self.buffer_addrs:
            for page in self.pages:
                page_addr = base + page * self.item_len + self.slice_offset
                for token in range(self.page_size):
                    yield page_addr + token * self.token_bytes, staging
                    staging += self.slice_bytes


class StagingPlan(msgspec.Struct, frozen=True):
    """Gather on the prefill, one bulk write, scatter on the decode."""

    gather: StagedSlices
    write: WriteOp
    scatter: StagedSlices


def plan_staged(
    src_layout: KvLayout,
    dst_layout: KvLayout,
    src_heads: HeadRange,
    dst_heads: HeadRange,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    *,
    src_staging_addr: int,
    dst_staging_addr: int,
) -> StagingPlan:
    """The staged equivalent of :func:`plan_head_slices` for one chunk of pages."""
    shared = _slice_geometry(src_layout, dst_layout, src_heads, dst_heads)
    _check_page_pairs(src_layout, dst_layout, src_pages, dst_pages)
    head_bytes = src_layout.head_bytes
    geometry = _SliceGeometry((shared.start - src_heads.start) * head_bytes,
                              (shared.start - dst_heads.start) * head_bytes,
                              shared.count * head_bytes)  # fmt: skip
    if not src_pages:
        raise InvalidInput("a chunk without pages has nothing to stage; skip the staging step")
    if src_staging_addr < 0 or dst_staging_addr < 0:
        raise InvalidInput("staging addresses must be >= 0")

    def slices(layout: KvLayout, pages: Sequence[int], offset: int, staging: int) -> StagedSlices:
        return StagedSlices(
            buffer_addrs=layout.buffer_addrs,
            pages=tuple(pages),
            page_size=layout.page_size,
            item_len=layout.item_len,
            token_bytes=layout.token_bytes,
            slice_offset=offset,
            slice_bytes=geometry.slice_bytes,
            staging_addr=staging,
        )

    gather = slices(src_layout, src_pages, geometry.src_offset, src_staging_addr)
    scatter = slices(dst_layout, dst_pages, geometry.dst_offset, dst_staging_addr)
    return StagingPlan(
        gather=gather,
        write=WriteOp(src_staging_addr, dst_staging_addr, gather.region_bytes),
        scatter=scatter,
    )


def split_batches(
    ops: Sequence[WriteOp], max_ops_per_batch: int
) -> tuple[tuple[WriteOp, ...], ...]:
    """Consecutive sub-batches of at most ``max_ops_per_batch`` ops, in the original order."""
    if max_ops_per_batch <= 0:
        raise InvalidInput(f"max_ops_per_batch must be positive, got {max_ops_per_batch}")
    return tuple(
        tuple(ops[start : start + max_ops_per_batch])
        for start in range(0, len(ops), max_ops_per_batch)
    )
