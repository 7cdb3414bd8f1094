"""Last-resort executor: plain Python and ctypes on host memory, no third-party packages."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from pdflow.core.dataplane.checksum import ByteRange, Checksum, checksum_ranges
from pdflow.core.dataplane.planning import StagedSlices, WriteOp
from pdflow.dataplane.backend import Backend
from pdflow.dataplane.host import memmove_write_ops, read_host


class PythonExecutor:
    """Moves one slice per ``memmove`` call; correct everywhere, fast nowhere."""

    backend = Backend.PYTHON

    def write(self, ops: Sequence[WriteOp]) -> None:
        memmove_write_ops(ops)

    def gather(self, slices: StagedSlices) -> None:
        for buffer_addr, staging_addr in slices.segments():
            ctypes.memmove(staging_addr, buffer_addr, slices.slice_bytes)

    def scatter(self, slices: StagedSlices) -> None:
        for buffer_addr, staging_addr in slices.segments():
            ctypes.memmove(buffer_addr, staging_addr, slices.slice_bytes)

    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum:
        return checksum_ranges(read_host, ranges)
