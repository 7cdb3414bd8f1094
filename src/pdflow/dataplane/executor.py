"""Choosing a data-plane executor: Triton when it can run here, else torch, numpy, Python."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Protocol

from pdflow.core.dataplane.checksum import ByteRange, Checksum
from pdflow.core.dataplane.planning import StagedSlices, WriteOp
from pdflow.dataplane.backend import Backend, available_backends, load_optional
from pdflow.dataplane.numpy_backend import NumpyExecutor
from pdflow.dataplane.pure import PythonExecutor
from pdflow.dataplane.torch_backend import TorchExecutor
from pdflow.dataplane.triton_backend import TritonExecutor


class Executor(Protocol):
    """Moves and checks bytes named by plan addresses, in one device's memory."""

    backend: Backend

    def write(self, ops: Sequence[WriteOp]) -> None:
        """Local copy of every op (source and destination in this memory)."""

    def gather(self, slices: StagedSlices) -> None:
        """Pack the slices into their staging region."""

    def scatter(self, slices: StagedSlices) -> None:
        """Unpack the staging region into the slices."""

    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum:
        """Checksum of the ranges' bytes, concatenated in order."""


def _required(name: str) -> ModuleType:
    module = load_optional(name)
    if module is None:
        raise RuntimeError(f"{name} disappeared after it was detected; reinstall it")
    return module


def make_executor(device: str = "cpu", backend: Backend | None = None) -> Executor:
    """The best executor for ``device`` memory, or the named ``backend`` if it can run."""
    found = available_backends(device)
    if not found:
        raise RuntimeError(
            f"no data-plane backend can reach {device!r} memory; install the 'kernels' extra "
            "(torch + triton) on a machine with that device"
        )
    chosen = found[0] if backend is None else backend
    if chosen not in found:
        raise RuntimeError(
            f"backend {chosen.value} cannot run on {device!r} here; available: "
            f"{[item.value for item in found]}"
        )
    if chosen is Backend.TRITON:
        return TritonExecutor(_required("kernels.triton_kernels"), device)
    if chosen is Backend.TORCH:
        return TorchExecutor(
            _required("torch"),
            _required("kernels.reference"),
            device,
        )
    if chosen is Backend.NUMPY:
        return NumpyExecutor(_required("numpy"))
    return PythonExecutor()
