"""Executor that launches the Triton kernels directly on plan addresses."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from pdflow.core.dataplane.checksum import ByteRange, Checksum
from pdflow.core.dataplane.planning import StagedSlices, WriteOp
from pdflow.dataplane.backend import Backend


def _geometry(slices: StagedSlices) -> dict[str, int]:
    return {
        "page_size": slices.page_size,
        "item_len": slices.item_len,
        "token_bytes": slices.token_bytes,
        "slice_offset": slices.slice_offset,
        "slice_bytes": slices.slice_bytes,
    }


class TritonExecutor:
    """One kernel launch per gather, scatter, batch of writes or checksum."""

    backend = Backend.TRITON

    def __init__(self, triton_kernels: ModuleType, device: str = "cpu") -> None:
        self._kernels = triton_kernels
        self._device = device

    def write(self, ops: Sequence[WriteOp]) -> None:
        self._kernels.copy_ranges(
            [(op.src_addr, op.dst_addr, op.length) for op in ops], device=self._device
        )

    def gather(self, slices: StagedSlices) -> None:
        self._kernels.gather_slices(
            slices.buffer_addrs,
            slices.pages,
            slices.staging_addr,
            device=self._device,
            **_geometry(slices),
        )

    def scatter(self, slices: StagedSlices) -> None:
        self._kernels.scatter_slices(
            slices.buffer_addrs,
            slices.pages,
            slices.staging_addr,
            device=self._device,
            **_geometry(slices),
        )

    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum:
        result: Checksum = self._kernels.checksum_ranges(list(ranges), device=self._device)
        return result
