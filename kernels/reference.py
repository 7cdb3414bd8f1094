"""Torch reference implementations of the data-plane kernels (any device, any dtype).

Buffers are paged tensors shaped ``[num_pages, page_size, ...]``; everything after the page
axis is flattened into one token row of ``width`` elements, and a *column* slice
``[col_start, col_start + col_count)`` of every token row is what moves (for KV: the shared heads
times head_dim). The staging tensor is flat; its first ``len(buffers) * len(pages) * page_size *
col_count`` elements hold the packed slices in buffer, page, token order, the byte layout fixed
in :mod:`pdflow.core.dataplane.planning`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdflow.core.dataplane.checksum import Checksum, fold, from_block_sums

# Position weights of one piece stay int64 and small enough that sums cannot overflow.
CHECKSUM_PIECE_BYTES = 1 << 20


def _rows(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.dim() < 2:
        raise ValueError("a paged buffer needs at least [num_pages, page_size] dimensions")
    return buffer.view(buffer.shape[0], buffer.shape[1], -1)


def _region(
    staging: torch.Tensor, buffers: Sequence[torch.Tensor], num_pages: int, col_count: int
) -> torch.Tensor:
    page_size = buffers[0].shape[1]
    shape = (len(buffers), num_pages, page_size, col_count)
    needed = len(buffers) * num_pages * page_size * col_count
    if staging.dim() != 1 or staging.numel() < needed:
        raise ValueError(f"staging must be a flat tensor of at least {needed} elements")
    if staging.dtype != buffers[0].dtype:
        raise ValueError(f"staging dtype {staging.dtype} differs from buffers' {buffers[0].dtype}")
    return staging[:needed].view(shape)


def gather_to_staging(
    buffers: Sequence[torch.Tensor],
    pages: torch.Tensor,
    col_start: int,
    col_count: int,
    staging: torch.Tensor,
) -> None:
    """Pack column slice of every token of ``pages`` in every buffer into ``staging``."""
    region = _region(staging, buffers, len(pages), col_count)
    for index, buffer in enumerate(buffers):
        region[index] = _rows(buffer)[pages, :, col_start : col_start + col_count]


def scatter_from_staging(
    staging: torch.Tensor,
    buffers: Sequence[torch.Tensor],
    pages: torch.Tensor,
    col_start: int,
    col_count: int,
) -> None:
    """Inverse of :func:`gather_to_staging`: unpack ``staging`` into the buffers' pages."""
    region = _region(staging, buffers, len(pages), col_count)
    for index, buffer in enumerate(buffers):
        _rows(buffer)[pages, :, col_start : col_start + col_count] = region[index]


def copy_pages(
    src_buffers: Sequence[torch.Tensor],
    dst_buffers: Sequence[torch.Tensor],
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
) -> None:
    """Copy whole pages ``src_pages[i] -> dst_pages[i]`` buffer by buffer."""
    if len(src_buffers) != len(dst_buffers) or len(src_pages) != len(dst_pages):
        raise ValueError("copy_pages needs equal buffer counts and equal page counts")
    for src, dst in zip(src_buffers, dst_buffers, strict=True):
        dst[dst_pages] = src[src_pages]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def checksum(chunks: Sequence[torch.Tensor]) -> Checksum:
    """Checksum (see :mod:`pdflow.core.dataplane.checksum`) of the tensors' bytes, in order."""
    parts = []
    for chunk in chunks:
        data = _as_bytes(chunk)
        for start in range(0, data.numel(), CHECKSUM_PIECE_BYTES):
            piece = data[start : start + CHECKSUM_PIECE_BYTES].to(torch.int64)
            weights = torch.arange(1, piece.numel() + 1, dtype=torch.int64, device=piece.device)
            parts.append(
                from_block_sums(
                    int(piece.sum().item()), int((piece * weights).sum().item()), piece.numel()
                )
            )
    return fold(parts)
