"""Triton data-plane kernels: staging gather/scatter, range (page) copy and checksum.

Every kernel works on raw addresses read from an int64 *pointer table*, so one launch covers all
layers' K and V buffers wherever they were allocated. Bytes are moved in the widest word (8, 4, 2
or 1 bytes) that divides every address, stride and length of the call, so the element dtype of
the KV cache does not matter. Two entry levels:

* address level (``gather_slices``, ``scatter_slices``, ``copy_ranges``, ``checksum_ranges``):
  the fields of :class:`pdflow.core.dataplane.planning.StagedSlices` / write ops, used by
  :mod:`pdflow.dataplane`;
* tensor level (``gather_to_staging``, ``scatter_from_staging``, ``copy_pages``, ``checksum``):
  the same signatures as :mod:`kernels.reference`, for tests and callers holding tensors.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (slowly), which is how CI tests them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pdflow.core.dataplane.checksum import Checksum, fold, from_block_sums
from pdflow.core.dataplane.planning import widest_word

_COPY_BLOCK = 1024
# Ranges are split so that a launch's second grid axis stays far below CUDA's 65535 limit.
_MAX_COPY_WORDS = _COPY_BLOCK * 4096
_CHECKSUM_BLOCK = 4096
# Keeps per-block position-weighted sums (and their per-piece totals) inside int64.
_CHECKSUM_PIECE_BYTES = _CHECKSUM_BLOCK * 4096

_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


def _word(values: Sequence[int]) -> tuple[int, tl.dtype]:
    """The widest word that divides every address and byte count of a launch."""
    size = widest_word(values)
    return size, _WORD_TYPES[size]


def _table(addrs: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(list(addrs), dtype=torch.int64, device=device)


@triton.jit  # type: ignore[untyped-decorator]
def _staging_kernel(  # type: ignore[no-untyped-def]
    table,
    pages,
    num_pages,
    page_size,
    item_words,
    token_words,
    offset_words,
    slice_words,
    staging_slot,
    TO_STAGING: tl.constexpr,
    WORD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program (buffer * num_pages + page_index, block): one block of one page's packed slices.
    packed = tl.program_id(0)
    buffer = packed // num_pages
    page = tl.load(pages + packed % num_pages)
    base = tl.load(table + buffer).to(tl.pointer_type(WORD))
    staging = tl.load(table + staging_slot).to(tl.pointer_type(WORD))
    per_page = page_size * slice_words
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < per_page
    token = offs // slice_words
    column = offs % slice_words
    buffer_ptr = base + page * item_words + token * token_words + offset_words + column
    staging_ptr = staging + packed.to(tl.int64) * per_page + offs
    if TO_STAGING:
        tl.store(staging_ptr, tl.load(buffer_ptr, mask=mask), mask=mask)
    else:
        tl.store(buffer_ptr, tl.load(staging_ptr, mask=mask), mask=mask)


def _launch_staging(
    to_staging: bool,
    buffer_addrs: Sequence[int],
    pages: Sequence[int],
    staging_addr: int,
    *,
    page_size: int,
    item_len: int,
    token_bytes: int,
    slice_offset: int,
    slice_bytes: int,
    device: torch.device | str,
) -> None:
    if not buffer_addrs or not pages:
        return
    size, word = _word(
        [*buffer_addrs, staging_addr, item_len, token_bytes, slice_offset, slice_bytes]
    )
    table = _table([*buffer_addrs, staging_addr], device)
    page_tensor = torch.tensor(list(pages), dtype=torch.int64, device=device)
    per_page_words = page_size * slice_bytes // size
    grid = (len(buffer_addrs) * len(pages), triton.cdiv(per_page_words, _COPY_BLOCK))
    _staging_kernel[grid](
        table,
        page_tensor,
        len(pages),
        page_size,
        item_len // size,
        token_bytes // size,
        slice_offset // size,
        slice_bytes // size,
        len(buffer_addrs),
        TO_STAGING=to_staging,
        WORD=word,
        BLOCK=_COPY_BLOCK,
    )


def gather_slices(
    buffer_addrs: Sequence[int],
    pages: Sequence[int],
    staging_addr: int,
    *,
    page_size: int,
    item_len: int,
    token_bytes: int,
    slice_offset: int,
    slice_bytes: int,
    device: torch.device | str,
) -> None:
    """Pack the slices of every (buffer, page, token) at ``staging_addr``, in one launch."""
    _launch_staging(
        True,
        buffer_addrs,
        pages,
        staging_addr,
        page_size=page_size,
        item_len=item_len,
        token_bytes=token_bytes,
        slice_offset=slice_offset,
        slice_bytes=slice_bytes,
        device=device,
    )


def scatter_slices(
    buffer_addrs: Sequence[int],
    pages: Sequence[int],
    staging_addr: int,
    *,
    page_size: int,
    item_len: int,
    token_bytes: int,
    slice_offset: int,
    slice_bytes: int,
    device: torch.device | str,
) -> None:
    """Unpack the region at ``staging_addr`` into every (buffer, page, token), in one launch."""
    _launch_staging(
        False,
        buffer_addrs,
        pages,
        staging_addr,
        page_size=page_size,
        item_len=item_len,
        token_bytes=token_bytes,
        slice_offset=slice_offset,
        slice_bytes=slice_bytes,
        device=device,
    )


@triton.jit  # type: ignore[untyped-decorator]
def _copy_kernel(table, lengths, num_ranges, WORD: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Program (range, block): table holds every range's source, then every destination.
    index = tl.program_id(0)
    length = tl.load(lengths + index)
    src = tl.load(table + index).to(tl.pointer_type(WORD))
    dst = tl.load(table + num_ranges + index).to(tl.pointer_type(WORD))
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < length
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_ranges(ranges: Sequence[tuple[int, int, int]], *, device: torch.device | str) -> None:
    """Copy every ``(src_addr, dst_addr, length)`` in one launch. Each copy's source and
    destination must not overlap (the blocks run in any order: not a memmove), or ValueError."""
    ranges = [item for item in ranges if item[2] > 0]
    if not ranges:
        return
    for src, dst, length in ranges:
        if src < dst + length and dst < src + length:
            raise ValueError(
                f"source [{src:#x}, +{length}) overlaps destination [{dst:#x}, +{length}): "
                "one launch copies blocks in any order; copy such a range with memmove"
            )
    size, word = _word([value for item in ranges for value in item])
    step = _MAX_COPY_WORDS * size
    pieces = [
        (src + start, dst + start, min(step, length - start))
        for src, dst, length in ranges
        for start in range(0, length, step)
    ]
    table = _table([p[0] for p in pieces] + [p[1] for p in pieces], device)
    lengths = _table([p[2] // size for p in pieces], device)
    longest = max(p[2] for p in pieces) // size
    _copy_kernel[(len(pieces), triton.cdiv(longest, _COPY_BLOCK))](
        table, lengths, len(pieces), WORD=word, BLOCK=_COPY_BLOCK
    )


@triton.jit  # type: ignore[untyped-decorator]
def _checksum_kernel(table, lengths, plain_out, weighted_out, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Program (piece, block): unreduced sums of one block, weights = position in the piece + 1.
    piece = tl.program_id(0)
    block = tl.program_id(1)
    slot = piece.to(tl.int64) * tl.num_programs(1) + block
    length = tl.load(lengths + piece)
    src = tl.load(table + piece).to(tl.pointer_type(tl.uint8))
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    data = tl.load(src + offs, mask=offs < length, other=0).to(tl.int64)
    tl.store(plain_out + slot, tl.sum(data, axis=0))
    tl.store(weighted_out + slot, tl.sum(data * (offs + 1), axis=0))


def checksum_ranges(ranges: Sequence[tuple[int, int]], *, device: torch.device | str) -> Checksum:
    """Checksum of the ``(addr, length)`` ranges' bytes, concatenated in order."""
    pieces = [
        (addr + start, min(_CHECKSUM_PIECE_BYTES, length - start))
        for addr, length in ranges
        for start in range(0, length, _CHECKSUM_PIECE_BYTES)
    ]
    if not pieces:
        return Checksum()
    blocks = triton.cdiv(max(length for _, length in pieces), _CHECKSUM_BLOCK)
    plain = torch.empty((len(pieces), blocks), dtype=torch.int64, device=device)
    weighted = torch.empty_like(plain)
    _checksum_kernel[(len(pieces), blocks)](
        _table([addr for addr, _ in pieces], device),
        _table([length for _, length in pieces], device),
        plain,
        weighted,
        BLOCK=_CHECKSUM_BLOCK,
    )
    sums = zip(plain.sum(dim=1).tolist(), weighted.sum(dim=1).tolist(), strict=True)
    return fold(
        from_block_sums(p, w, length) for (p, w), (_, length) in zip(sums, pieces, strict=True)
    )


# Tensor-level wrappers, signature-compatible with kernels.reference.


def _geometry(buffers: Sequence[torch.Tensor], col_start: int, col_count: int) -> dict[str, int]:
    first = buffers[0]
    for buffer in buffers:
        if not buffer.is_contiguous() or buffer.dtype != first.dtype or buffer.shape != first.shape:
            raise ValueError("buffers must be contiguous and share one shape and dtype")
    itemsize = first.element_size()
    page_size = first.shape[1]
    width = first[0, 0].numel()
    if not 0 <= col_start <= col_start + col_count <= width:
        raise ValueError(f"columns [{col_start}, {col_start + col_count}) exceed width {width}")
    return {
        "page_size": page_size,
        "item_len": page_size * width * itemsize,
        "token_bytes": width * itemsize,
        "slice_offset": col_start * itemsize,
        "slice_bytes": col_count * itemsize,
    }


def _staging_addr(
    staging: torch.Tensor, buffers: Sequence[torch.Tensor], pages: torch.Tensor, col_count: int
) -> int:
    pool = buffers[0].shape[0]
    if len(pages) and not (int(pages.min()) >= 0 and int(pages.max()) < pool):
        # The kernels index raw addresses: a page outside the pool reads or writes other memory.
        raise IndexError(f"page indices must be in [0, {pool}), got {pages.tolist()}")
    needed = len(buffers) * len(pages) * buffers[0].shape[1] * col_count
    if staging.dim() != 1 or staging.numel() < needed or staging.dtype != buffers[0].dtype:
        raise ValueError(f"staging must be a flat {buffers[0].dtype} tensor of >= {needed} items")
    return int(staging.data_ptr())


def gather_to_staging(
    buffers: Sequence[torch.Tensor],
    pages: torch.Tensor,
    col_start: int,
    col_count: int,
    staging: torch.Tensor,
) -> None:
    gather_slices(
        [int(b.data_ptr()) for b in buffers],
        pages.tolist(),
        _staging_addr(staging, buffers, pages, col_count),
        device=staging.device,
        **_geometry(buffers, col_start, col_count),
    )


def scatter_from_staging(
    staging: torch.Tensor,
    buffers: Sequence[torch.Tensor],
    pages: torch.Tensor,
    col_start: int,
    col_count: int,
) -> None:
    scatter_slices(
        [int(b.data_ptr()) for b in buffers],
        pages.tolist(),
        _staging_addr(staging, buffers, pages, col_count),
        device=staging.device,
        **_geometry(buffers, col_start, col_count),
    )


def copy_pages(
    src_buffers: Sequence[torch.Tensor],
    dst_buffers: Sequence[torch.Tensor],
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    if len(src_buffers) != len(dst_buffers) or len(src_pages) != len(dst_pages):
        raise ValueError("copy_pages needs equal buffer counts and equal page counts")
    item_len = _geometry(src_buffers, 0, 0)["item_len"]
    if _geometry(dst_buffers, 0, 0)["item_len"] != item_len:
        raise ValueError("source and destination pages differ in byte size")
    copy_ranges(
        [
            (int(src.data_ptr()) + s * item_len, int(dst.data_ptr()) + d * item_len, item_len)
            for src, dst in zip(src_buffers, dst_buffers, strict=True)
            for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True)
        ],
        device=src_buffers[0].device,
    )


def checksum(chunks: Sequence[torch.Tensor]) -> Checksum:
    contiguous = [chunk.contiguous() for chunk in chunks]
    if not contiguous:
        return Checksum()
    return checksum_ranges(
        [(int(c.data_ptr()), c.numel() * c.element_size()) for c in contiguous],
        device=contiguous[0].device,
    )
