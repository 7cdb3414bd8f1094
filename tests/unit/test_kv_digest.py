"""The end-to-end KV digest: bytes moved between destination pages or buffers change it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pdflow.core.dataplane.buffers import KvBuffer, KvBuffers, KvRole, TpPlace, destination_slices
from pdflow.io.kv_buffers import default_executor, kv_digest

POOL, ITEM = 8, 64


@pytest.fixture
def memory() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=2 * POOL * ITEM, dtype=np.uint8)


def digest_of(memory: np.ndarray) -> int:
    base = memory.ctypes.data
    size = POOL * ITEM
    kv = KvBuffers(4, (KvBuffer(base, size, ITEM, 0, KvRole.K, 2),
                       KvBuffer(base + size, size, ITEM, 0, KvRole.V, 2)))  # fmt: skip
    place = TpPlace(1, 0)
    pages = list(range(POOL))
    return kv_digest(default_executor(), destination_slices(kv, place, place), pages, pages, POOL)


def at(page: int, position: int, buffer: int = 0) -> int:
    return buffer * POOL * ITEM + page * ITEM + position


def swap(memory: np.ndarray, a: int, b: int) -> None:
    memory[a], memory[b] = memory[b].copy(), memory[a].copy()


@pytest.mark.parametrize(
    ("name", "corrupt"),
    [
        ("one byte flipped", lambda m: m.__setitem__(at(3, 5), m[at(3, 5)] ^ 1)),
        # With the key only added to each byte's weight, these two weighed the same.
        ("bytes swapped across neighbouring pages", lambda m: swap(m, at(3, 10), at(2, 11))),
        ("+1 and -1 across neighbouring pages",
         lambda m: (m.__setitem__(at(3, 10), m[at(3, 10)] + 1),
                    m.__setitem__(at(2, 11), m[at(2, 11)] - 1))),
        ("bytes swapped across K and V", lambda m: swap(m, at(2, 20), at(2, 20 - POOL, 1))),
    ],
)
def test_bytes_moved_between_pages_or_buffers_change_the_digest(
    memory: np.ndarray, name: str, corrupt: Callable[[np.ndarray], object]
) -> None:
    before = digest_of(memory)
    corrupt(memory)
    assert digest_of(memory) != before, name


def test_pages_whose_bytes_are_permutations_of_each_other_cannot_trade_places(
    memory: np.ndarray,
) -> None:
    memory[at(5, 0):at(6, 0)] = memory[at(4, 0):at(5, 0)][::-1]  # equal byte sums
    before = digest_of(memory)
    page4, page5 = memory[at(4, 0):at(5, 0)].copy(), memory[at(5, 0):at(6, 0)].copy()
    memory[at(4, 0):at(5, 0)], memory[at(5, 0):at(6, 0)] = page5, page4
    assert digest_of(memory) != before
