"""Executor that runs the torch reference kernels on memory named by address (CPU or CUDA)."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from pdflow.core.dataplane.checksum import ByteRange, Checksum
from pdflow.core.dataplane.planning import StagedSlices, WriteOp
from pdflow.dataplane.backend import Backend, is_cuda_device
from pdflow.dataplane.host import host_bytes, memmove_write_ops


class _CudaBytes:
    """Lets torch wrap ``length`` device bytes at ``addr`` without copying."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


class TorchExecutor:
    """Wraps addresses as uint8 tensors and applies :mod:`kernels.reference`."""

    backend = Backend.TORCH

    def __init__(self, torch: ModuleType, reference: ModuleType, device: str = "cpu") -> None:
        self._torch = torch
        self._reference = reference
        self._device = device

    def _bytes(self, addr: int, length: int) -> Any:
        torch = self._torch
        if is_cuda_device(self._device):
            return torch.as_tensor(_CudaBytes(addr, length), device=self._device)
        return torch.frombuffer(host_bytes(addr, length), dtype=torch.uint8)

    def _words(self, addr: int, length: int, word: int) -> Any:
        """Memory as a tensor of ``word``-byte integers: wide copies instead of byte copies."""
        dtype = {8: self._torch.int64, 4: self._torch.int32, 2: self._torch.int16}.get(word)
        data = self._bytes(addr, length)
        return data if dtype is None else data.view(dtype)

    def _buffers(self, slices: StagedSlices) -> list[Any]:
        num_pages = max(slices.pages) + 1
        word = slices.word_bytes
        return [
            self._words(base, num_pages * slices.item_len, word).view(
                num_pages, slices.page_size, slices.token_bytes // word
            )
            for base in slices.buffer_addrs
        ]

    def _staging(self, slices: StagedSlices) -> Any:
        return self._words(slices.staging_addr, slices.region_bytes, slices.word_bytes)

    def _pages(self, slices: StagedSlices) -> Any:
        return self._torch.tensor(slices.pages, dtype=self._torch.int64, device=self._device)

    def write(self, ops: Sequence[WriteOp]) -> None:
        if not is_cuda_device(self._device):
            memmove_write_ops(ops)
            return
        for op in ops:
            self._bytes(op.dst_addr, op.length).copy_(self._bytes(op.src_addr, op.length))

    def gather(self, slices: StagedSlices) -> None:
        if slices.region_bytes == 0:
            return
        word = slices.word_bytes
        self._reference.gather_to_staging(
            self._buffers(slices),
            self._pages(slices),
            slices.slice_offset // word,
            slices.slice_bytes // word,
            self._staging(slices),
        )

    def scatter(self, slices: StagedSlices) -> None:
        if slices.region_bytes == 0:
            return
        word = slices.word_bytes
        self._reference.scatter_from_staging(
            self._staging(slices),
            self._buffers(slices),
            self._pages(slices),
            slices.slice_offset // word,
            slices.slice_bytes // word,
        )

    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum:
        result: Checksum = self._reference.checksum(
            [self._bytes(addr, length) for addr, length in ranges if length > 0]
        )
        return result
