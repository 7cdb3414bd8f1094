"""Deterministic KV contents for node tests: every byte names its room, buffer, page position,
token, global head and offset, so a decode can check what landed without trusting checksums."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdflow.io.kv_buffers import HostKvCache, RankKv

GEOMETRY = {"num_layers": 2, "page_size": 16, "head_dim": 16, "total_kv_heads": 4}


def page_view(cache: HostKvCache, kv: RankKv) -> np.ndarray:
    """``[buffer, page, token, head, byte]`` over the cache memory (no copy)."""
    layout = kv.layout
    return np.frombuffer(memoryview(cache.memory).cast("B"), dtype=np.uint8).reshape(
        2 * layout.num_layers, layout.num_pages, layout.page_size, layout.num_heads,
        layout.head_bytes,
    )  # fmt: skip


def pattern(room: int, positions: int, kv: RankKv) -> np.ndarray:
    """The bytes of a room's first ``positions`` pages for the heads ``kv`` holds."""
    layout, heads = kv.layout, kv.heads
    b = np.arange(2 * layout.num_layers).reshape(-1, 1, 1, 1, 1)
    pos = np.arange(positions).reshape(1, -1, 1, 1, 1)
    t = np.arange(layout.page_size).reshape(1, 1, -1, 1, 1)
    h = np.arange(heads.start, heads.stop).reshape(1, 1, 1, -1, 1)
    d = np.arange(layout.head_bytes).reshape(1, 1, 1, 1, -1)
    values = room * 131 + b * 71 + pos * 31 + t * 7 + h * 13 + d
    return (values % 251).astype(np.uint8)


def fill(cache: HostKvCache, kv: RankKv, room: int, pages: Sequence[int]) -> None:
    page_view(cache, kv)[:, list(pages)] = pattern(room, len(pages), kv)


def matches(cache: HostKvCache, kv: RankKv, room: int, pages: Sequence[int]) -> bool:
    return bool(np.array_equal(page_view(cache, kv)[:, list(pages)],
                               pattern(room, len(pages), kv)))  # fmt: skip


def pages_for(tokens: int) -> int:
    return -(-tokens // GEOMETRY["page_size"])
