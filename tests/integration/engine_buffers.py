"""An engine's own KV buffers for node tests: tensors with their own layer ids, roles, TP
splits, head sizes and page orders, in host memory, filled and checked by a pattern in which
every byte names its room, tensor, page position, token, global head and offset.

A model is a list of tensor specs (JSON-able, so a prefill subprocess builds the same model):
``{"role": "k"|"v"|"latent", "layer": L, "heads": total heads (1: replicated),
"head_bytes": B, "order": "nhd"|"hnd", "draft": false}``, and ``"id"``, the tensor's number in the
pattern (default: its position), so a pipeline stage holding some of the tensors fills them as
the whole model would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdflow.core.dataplane.buffers import KvBuffer, KvBuffers, KvRole, PageOrder
from pdflow.core.dataplane.layout import rank_head_range
from pdflow.io.kv_buffers import RankKv

PAGE_SIZE = 4

Model = list[dict[str, Any]]


class EngineKv:
    """One rank's tensors, one numpy array each, and their description."""

    def __init__(self, model: Model, tp_size: int, tp_rank: int, num_pages: int,
                 reverse: bool = False) -> None:  # fmt: skip
        self.model = model
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.arrays: list[np.ndarray] = []
        self.order = list(range(len(model)))[:: -1 if reverse else 1]  # engines list freely
        buffers = []
        for index in self.order:
            spec = model[index]
            heads = self.heads(index).count
            item_len = PAGE_SIZE * heads * spec["head_bytes"]
            array = np.zeros(num_pages * item_len, dtype=np.uint8)
            self.arrays.append(array)
            buffers.append(KvBuffer(array.ctypes.data, array.size, item_len, spec["layer"],
                                    KvRole(spec["role"]), spec["heads"], spec.get("draft", False),
                                    PageOrder(spec["order"])))  # fmt: skip
        self.kv = RankKv(KvBuffers(PAGE_SIZE, tuple(buffers)), tp_size, tp_rank,
                         max(spec["heads"] for spec in model))  # fmt: skip

    def heads(self, index: int) -> Any:
        return rank_head_range(self.model[index]["heads"], self.tp_size, self.tp_rank)

    def pages_view(self, slot: int) -> np.ndarray:
        """``[page, ...]`` of one buffer, the page in its own order (NHD or HND)."""
        spec = self.model[self.order[slot]]
        heads = self.heads(self.order[slot]).count
        shape = ((PAGE_SIZE, heads) if spec["order"] == "nhd" else (heads, PAGE_SIZE))
        return self.arrays[slot].reshape(-1, *shape, spec["head_bytes"])

    def expected(self, slot: int, room: int, positions: int) -> np.ndarray:
        index = self.order[slot]
        spec, heads = self.model[index], self.heads(index)
        pos = np.arange(positions).reshape(-1, 1, 1, 1)
        token = np.arange(PAGE_SIZE).reshape(1, -1, 1, 1)
        head = np.arange(heads.start, heads.stop).reshape(1, 1, -1, 1)
        byte = np.arange(spec["head_bytes"]).reshape(1, 1, 1, -1)
        tensor_id = spec.get("id", index)
        values = (room * 7 + tensor_id * 53 + pos * 29 + token * 17 + head * 11 + byte * 3
                  + 1) % 251  # fmt: skip
        values = values.astype(np.uint8)
        return values if spec["order"] == "nhd" else values.transpose(0, 2, 1, 3)

    def fill(self, room: int, pages: Sequence[int]) -> None:
        for slot in range(len(self.arrays)):
            self.pages_view(slot)[list(pages)] = self.expected(slot, room, len(pages))

    def mismatches(self, room: int, pages: Sequence[int]) -> list[str]:
        """The tensors whose bytes in ``pages`` are not the room's pattern."""
        wrong = []
        for slot in range(len(self.arrays)):
            if not np.array_equal(self.pages_view(slot)[list(pages)],
                                  self.expected(slot, room, len(pages))):  # fmt: skip
                spec = self.model[self.order[slot]]
                wrong.append(f"{spec['role']}{spec['layer']}")
        return wrong


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def source_pages(room: int, count: int, num_pages: int) -> list[int]:
    """Scattered, distinct source pages (``num_pages`` odd, so ``2 i`` never repeats)."""
    return [(room + 2 * i) % num_pages for i in range(count)]
