"""Raw access to host (CPU) memory by address: the in-process transport's memcpy."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from pdflow.core.dataplane.planning import WriteOp


def memmove_write_ops(ops: Sequence[WriteOp]) -> None:
    """Perform each write as one memcpy between host addresses (the in-process transport)."""
    memmove = ctypes.memmove
    for op in ops:
        memmove(op.dst_addr, op.src_addr, op.length)


def read_host(addr: int, length: int) -> bytes:
    """Copy ``length`` bytes starting at host address ``addr``."""
    return ctypes.string_at(addr, length)


def host_bytes(addr: int, length: int) -> ctypes.Array[ctypes.c_uint8]:
    """A ctypes byte array aliasing host memory (no copy), for numpy/torch to wrap."""
    return (ctypes.c_uint8 * length).from_address(addr)
