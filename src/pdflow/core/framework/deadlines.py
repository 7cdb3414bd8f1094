"""A deadline queue for many keys: O(log n) re-arming, stale heap entries skipped lazily.

Stale entries (a key disarmed or re-armed) stay in the heap until they reach its top; when they
outnumber the live ones the heap is rebuilt from the live deadlines, so its size stays within
a constant factor of the armed keys and each operation costs O(log n) amortized, however many
rooms come and go before their deadlines.

The earliest live deadline is remembered between calls: endpoints ask for it on every step
(the step's ``timer_at``), and most steps arm nothing or only disarm a key that was not armed,
which leaves it as it was.
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
        self._next: float | None = None
        self._next_known = True
        """``_next`` is the earliest live deadline (None: nothing armed) while this holds."""

    def arm(self, key: K, deadline: float | None) -> None:
        current = self._current
        if deadline is None:
            old = current.pop(key, None)
            if old is not None and old == self._next:
                self._next_known = False  # it was (one of) the earliest: found again on demand
            return
        old = current.get(key)
        if old == deadline:
            return
        current[key] = deadline
        self._pushes += 1
        heapq.heappush(self._heap, (deadline, self._pushes, key))
        if self._next_known:
            earliest = self._next
            if old is not None and old == earliest:
                self._next_known = False
            elif earliest is None or deadline < earliest:
                self._next = deadline
        if len(self._heap) > 2 * len(current) + 64:
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
        if due:
            self._next_known = False
        return due

    def next_deadline(self) -> float | None:
        if self._next_known:
            return self._next
        heap, current = self._heap, self._current
        earliest: float | None = None
        while heap:
            deadline, _, key = heap[0]
            if current.get(key) == deadline:
                earliest = deadline
                break
            heapq.heappop(heap)  # stale: its key was disarmed or re-armed
        self._next, self._next_known = earliest, True
        return earliest

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale ones included (bounded by about twice the armed keys)."""
        return len(self._heap)

    def __len__(self) -> int:
        return len(self._current)
