"""What a chaos room's KV bytes must be, and the canary a free decode page holds.

Every byte of a room's pages is a function of (room, generation, buffer, page position, token,
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


def pattern(room: int, generation: int, positions: int, kv: RankKv) -> np.ndarray:
    layout, heads = kv.token_layout, kv.heads
    b = np.arange(2 * layout.num_layers).reshape(-1, 1, 1, 1, 1)
    pos = np.arange(positions).reshape(1, -1, 1, 1, 1)
    t = np.arange(layout.page_size).reshape(1, 1, -1, 1, 1)
    h = np.arange(heads.start, heads.stop).reshape(1, 1, 1, -1, 1)
    d = np.arange(layout.head_bytes).reshape(1, 1, 1, 1, -1)
    seed = (room * 131 + generation * 977) % 251
    values = seed + b * 71 + pos * 31 + t * 7 + h * 13 + d
    return (values % 251).astype(np.uint8)


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
