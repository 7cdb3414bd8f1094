"""What a chaos room's KV bytes must be, and the canary a free decode page holds.

Every byte of a room's pages is a hash of (room, generation, buffer, page position, token,
global head, offset), in ``[0, 250]``; so a decode checks exactly what landed without trusting
the checksums, and a write from an earlier generation of the same room id is told apart. A
released page is filled with :data:`CANARY` (251), which no pattern byte can equal: any other
byte in a free page was written after the page was released.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdflow.core.dataplane.layout import KvDtype
from pdflow.io.kv_buffers import HostKvCache, RankKv, host_cache_for_rank

GEOMETRY = {"num_layers": 2, "page_size": 16, "head_dim": 16, "total_kv_heads": 4}
DTYPE = KvDtype.FP16
CANARY = 251


def rank_caches(tp: int, num_pages: int) -> list[tuple[HostKvCache, RankKv]]:
    """One host KV cache per TP rank of an instance, in the chaos geometry."""
    return [host_cache_for_rank(tp_size=tp, tp_rank=r, num_pages=num_pages, dtype=DTYPE,
                                **GEOMETRY) for r in range(tp)]  # fmt: skip


def pages_for(tokens: int) -> int:
    return -(-tokens // GEOMETRY["page_size"])


def page_view(cache: HostKvCache, kv: RankKv) -> np.ndarray:
    """``[buffer, page, token, head, byte]`` over the cache memory (no copy)."""
    layout = kv.token_layout
    return np.frombuffer(memoryview(cache.memory).cast("B"), dtype=np.uint8).reshape(
        2 * layout.num_layers, layout.num_pages, layout.page_size, layout.num_heads,
        layout.head_bytes,
    )  # fmt: skip


_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def pattern(room: int, generation: int, positions: int, kv: RankKv) -> np.ndarray:
    """A hash of (room, generation, buffer, position, token, global head, offset) mod 251: two
    room instances' bytes agree at a given place with probability 1/251 each, independently, so
    another room's chunk landing in these pages differs in almost every byte."""
    layout, heads = kv.token_layout, kv.heads
    key = _mix(np.array([(room * 0x9E3779B97F4A7C15 + generation + 1) & _MASK], np.uint64))[0]
    b = np.arange(2 * layout.num_layers, dtype=np.uint64).reshape(-1, 1, 1, 1, 1)
    pos = np.arange(positions, dtype=np.uint64).reshape(1, -1, 1, 1, 1)
    t = np.arange(layout.page_size, dtype=np.uint64).reshape(1, 1, -1, 1, 1)
    h = np.arange(heads.start, heads.stop, dtype=np.uint64).reshape(1, 1, 1, -1, 1)
    d = np.arange(layout.head_bytes, dtype=np.uint64).reshape(1, 1, 1, 1, -1)
    # A place's index in the room's whole (all heads) KV, so every TP split agrees on it.
    total_heads = np.uint64(GEOMETRY["total_kv_heads"])
    place = (((b * np.uint64(1 << 20) + pos) * np.uint64(layout.page_size) + t) * total_heads
             + h) * np.uint64(layout.head_bytes) + d  # fmt: skip
    return (_mix(place ^ key) % np.uint64(251)).astype(np.uint8)


def fill(cache: HostKvCache, kv: RankKv, room: int, generation: int,
         pages: Sequence[int]) -> None:  # fmt: skip
    page_view(cache, kv)[:, list(pages)] = pattern(room, generation, len(pages), kv)


def mismatch(cache: HostKvCache, kv: RankKv, room: int, generation: int,
             pages: Sequence[int]) -> str:  # fmt: skip
    """Empty when the pages hold exactly the room's bytes; else where they differ first."""
    got = page_view(cache, kv)[:, list(pages)]
    want = pattern(room, generation, len(pages), kv)
    bad = np.argwhere(got != want)
    if not len(bad):
        return ""
    first = tuple(int(x) for x in bad[0])
    return (f"{len(bad)} bytes differ; first at [buffer, position, token, head, byte]={first}: "
            f"got {int(got[first])}, expected {int(want[first])}")  # fmt: skip


def paint_canary(cache: HostKvCache, kv: RankKv, pages: Sequence[int]) -> None:
    page_view(cache, kv)[:, list(pages)] = CANARY


def broken_canaries(cache: HostKvCache, kv: RankKv, pages: Sequence[int]) -> list[int]:
    """The pages among ``pages`` holding any byte other than the canary."""
    if not pages:
        return []
    view = page_view(cache, kv)[:, list(pages)]
    intact = (view == CANARY).reshape(view.shape[0], view.shape[1], -1).all(axis=(0, 2))
    return [page for page, ok in zip(pages, intact, strict=True) if not ok]
