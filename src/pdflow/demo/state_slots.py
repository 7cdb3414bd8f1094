"""The demo engines' model-state pool: one recurrent memory vector per request in flight.

The tiny model's recurrent state (``TinyTransformer.new_memory``) is the one model-state
component the demo moves: an opaque per-request item (``StateKind.BLOB``) that pdflow writes
with the last chunk into the slot the decode published, checksum-verified like the KV.
"""

from __future__ import annotations

import ctypes

import torch

from pdflow.core.dataplane.layout import StateBuffers, StateKind


class MemorySlots:
    """``num_slots`` float32 vectors of ``d_model`` in host memory, and their allocator."""

    def __init__(self, d_model: int, num_slots: int) -> None:
        item_bytes = d_model * 4
        self._memory = (ctypes.c_uint8 * (num_slots * item_bytes))()
        self._vectors = torch.frombuffer(self._memory, dtype=torch.float32).view(num_slots, d_model)
        self.component = StateBuffers(
            StateKind.BLOB, (ctypes.addressof(self._memory),), (item_bytes,), num_slots
        )
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("every state slot is in use; give the engine more slots")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def vector(self, slot: int) -> torch.Tensor:
        """The slot's memory itself (a view: writing it writes the slot)."""
        return self._vectors[slot]
