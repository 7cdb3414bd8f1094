"""A deadline queue for many keys: O(log n) re-arming, stale heap entries skipped lazily.

Stale entries (a key disarmed or re-armed) stay in the heap until they reach its top; when they
outnumber the live ones the heap is rebuilt from the live deadlines, so its size stays within
a constant factor of the armed keys and each operation costs O(log n) amortized, however many
rooms come and go before their deadlines.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._current: dict[K, float] = {}
        self._pushes = 0  # tie-breaker: equal deadlines pop in arming order, deterministically

    def arm(self, key: K, deadline: float | None) -> None:
        if deadline is None:
            self._current.pop(key, None)
            return
        if self._current.get(key) == deadline:
            return
        self._current[key] = deadline
        self._pushes += 1
        heapq.heappush(self._heap, (deadline, self._pushes, key))
        if len(self._heap) > 2 * len(self._current) + 64:
            self._compact()

    def _compact(self) -> None:
        # Keep, per live key, the entry that would pop first (same order as before the rebuild).
        live: dict[K, tuple[float, int, K]] = {}
        for entry in self._heap:
            deadline, pushed, key = entry
            if self._current.get(key) == deadline and (key not in live or pushed < live[key][1]):
                live[key] = entry
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def pop_due(self, now: float) -> list[K]:
        due: list[K] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if self._current.get(key) == deadline:
                del self._current[key]
                due.append(key)
        return due

    def next_deadline(self) -> float | None:
        heap, current = self._heap, self._current
        while heap:
            deadline, _, key = heap[0]
            if current.get(key) == deadline:
                return deadline
            heapq.heappop(heap)  # stale: its key was disarmed or re-armed
        return None

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale ones included (bounded by about twice the armed keys)."""
        return len(self._heap)

    def __len__(self) -> int:
        return len(self._current)
