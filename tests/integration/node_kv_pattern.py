"""Deterministic KV contents for node tests: every byte names its room, buffer, page position,
token, global head and offset, so a decode can check what landed without trusting checksums."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdflow.chaos.kv_pattern import GEOMETRY, page_view, pages_for
from pdflow.chaos.kv_pattern import pattern as room_pattern
from pdflow.io.kv_buffers import HostKvCache, RankKv


def pattern(room: int, positions: int, kv: RankKv) -> np.ndarray:
    """The bytes of a room's first ``positions`` pages for the heads ``kv`` holds."""
    return room_pattern(room, 0, positions, kv)


def fill(cache: HostKvCache, kv: RankKv, room: int, pages: Sequence[int]) -> None:
    page_view(cache, kv)[:, list(pages)] = pattern(room, len(pages), kv)


def matches(cache: HostKvCache, kv: RankKv, room: int, pages: Sequence[int]) -> bool:
    return bool(np.array_equal(page_view(cache, kv)[:, list(pages)],
                               pattern(room, len(pages), kv)))  # fmt: skip


__all__ = ["GEOMETRY", "fill", "matches", "page_view", "pages_for", "pattern"]
