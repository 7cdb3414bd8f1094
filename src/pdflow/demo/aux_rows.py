"""The demo engines' aux (metadata) buffers: one row per request in flight.

A row holds what the decode needs before it may run a request and that is not KV: the first
output token the prefill sampled, and the bootstrap room the row belongs to (SGLang's check
against a row of another request: "context corruption"). pdflow moves the row from the prefill's
slot into the decode's before the decode sees Success; the router relays nothing.
"""

from __future__ import annotations

import ctypes
import struct

from pdflow.core.dataplane.layout import AuxBuffer
from pdflow.io.kv_buffers import read_aux_row, write_aux_row

AUX_ROW = struct.Struct("<qq")
"""first token, bootstrap room (int64 each)."""


class AuxRows:
    """A host aux buffer and its row allocator."""

    def __init__(self, num_rows: int) -> None:
        self._memory = (ctypes.c_uint8 * (num_rows * AUX_ROW.size))()
        self.buffer = AuxBuffer.single(ctypes.addressof(self._memory), AUX_ROW.size, num_rows)
        self._free = list(range(num_rows))

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("every aux row is in use; give the engine more rows")
        index = self._free.pop()
        write_aux_row(self.buffer, index, bytes(AUX_ROW.size))  # no stale row of another room
        return index

    def free(self, index: int) -> None:
        self._free.append(index)

    def write(self, index: int, first_token: int, room: int) -> None:
        write_aux_row(self.buffer, index, AUX_ROW.pack(first_token, room))

    def read(self, index: int) -> tuple[int, int]:
        first_token, room = AUX_ROW.unpack(read_aux_row(self.buffer, index))
        return first_token, room
