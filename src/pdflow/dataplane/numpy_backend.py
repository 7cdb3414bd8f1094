"""Host-memory executor built on numpy strided views (no torch needed)."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from pdflow.core.dataplane.checksum import ByteRange, Checksum, fold, from_block_sums
from pdflow.core.dataplane.planning import StagedSlices, WriteOp
from pdflow.dataplane.backend import Backend
from pdflow.dataplane.host import host_bytes, memmove_write_ops

# Position weights of one piece stay int64 and small enough that sums cannot overflow.
_CHECKSUM_PIECE_BYTES = 1 << 20


class NumpyExecutor:
    """Gathers and scatters whole buffers at a time with fancy indexing on strided views."""

    backend = Backend.NUMPY

    def __init__(self, numpy: ModuleType) -> None:
        self._np = numpy
        self._weights = numpy.arange(1, _CHECKSUM_PIECE_BYTES + 1, dtype=numpy.int64)

    def _bytes(self, addr: int, length: int) -> Any:
        return self._np.ctypeslib.as_array(host_bytes(addr, length))

    def _slice_views(self, slices: StagedSlices) -> tuple[list[Any], Any, Any]:
        """Per-buffer ``[page, token, slice word]`` views, the page index array, the region.

        Views use the widest word the geometry allows; copying bytes one by one is ~8x slower.
        """
        np = self._np
        word = slices.word_bytes
        dtype = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}[word]
        num_pages = max(slices.pages) + 1

        def words(addr: int, length: int) -> Any:
            return self._bytes(addr, length).view(dtype)

        views = [
            np.lib.stride_tricks.as_strided(
                words(
                    base + slices.slice_offset, num_pages * slices.item_len - slices.slice_offset
                ),
                shape=(num_pages, slices.page_size, slices.slice_bytes // word),
                strides=(slices.item_len, slices.token_bytes, word),
            )
            for base in slices.buffer_addrs
        ]
        region = words(slices.staging_addr, slices.region_bytes).reshape(
            len(slices.buffer_addrs), len(slices.pages), slices.page_size, -1
        )
        return views, np.asarray(slices.pages, dtype=np.int64), region

    def write(self, ops: Sequence[WriteOp]) -> None:
        memmove_write_ops(ops)

    def gather(self, slices: StagedSlices) -> None:
        if slices.region_bytes == 0:
            return
        views, pages, region = self._slice_views(slices)
        for index, view in enumerate(views):
            region[index] = view[pages]

    def scatter(self, slices: StagedSlices) -> None:
        if slices.region_bytes == 0:
            return
        views, pages, region = self._slice_views(slices)
        for index, view in enumerate(views):
            view[pages] = region[index]

    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum:
        parts = []
        for addr, length in ranges:
            if length == 0:
                continue
            data = self._bytes(addr, length)
            for start in range(0, length, _CHECKSUM_PIECE_BYTES):
                piece = data[start : start + _CHECKSUM_PIECE_BYTES].astype(self._np.int64)
                weighted = int(piece @ self._weights[: piece.size])
                parts.append(from_block_sums(int(piece.sum()), weighted, int(piece.size)))
        return fold(parts)
