"""A deadline queue for many keys: O(log n) re-arming, stale heap entries skipped lazily.

Stale entries (a key disarmed or re-armed) stay in the heap until they reach its top; when they
outnumber the live ones the heap is rebuilt from the live deadlines, so its size stays within
a constant factor of the armed keys and each operation costs O(log n) amortized, however many
rooms come and go before their deadlines.

The earliest live deadline is kept in ``earliest`` (an attribute: endpoints read it on every
step, for the step's ``timer_at``); it is found again only when the key holding it is disarmed
or re-armed, or keys are popped, so most steps, which arm nothing or disarm a key that was not
armed, leave it as it was.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self.armed: dict[K, float] = {}
        """Each armed key's deadline. Read it (a caller about to disarm a key may skip the call
        when the key is not armed); only the queue writes it."""
        self._pushes = 0  # tie-breaker: equal deadlines pop in arming order, deterministically
        self.earliest: float | None = None
        """The earliest armed deadline (None: nothing armed). Read it; only the queue writes it."""

    def arm(self, key: K, deadline: float | None) -> None:
        current = self.armed
        if deadline is None:
            old = current.pop(key, None)
            if old is not None and old == self.earliest:
                self._find_earliest()  # it was (one of) the earliest
            return
        old = current.get(key)
        if old == deadline:
            return
        current[key] = deadline
        self._pushes += 1
        heapq.heappush(self._heap, (deadline, self._pushes, key))
        earliest = self.earliest
        if old is not None and old == earliest:
            self._find_earliest()
        elif earliest is None or deadline < earliest:
            self.earliest = deadline
        if len(self._heap) > 2 * len(current) + 64:
            self._compact()

    def _find_earliest(self) -> None:
        heap, current = self._heap, self.armed
        while heap:
            deadline, _, key = heap[0]
            if current.get(key) == deadline:
                self.earliest = deadline
                return
            heapq.heappop(heap)  # stale: its key was disarmed or re-armed
        self.earliest = None

    def _compact(self) -> None:
        # Keep, per live key, the entry that would pop first (same order as before the rebuild).
        live: dict[K, tuple[float, int, K]] = {}
        for entry in self._heap:
            deadline, pushed, key = entry
            if self.armed.get(key) == deadline and (key not in live or pushed < live[key][1]):
                live[key] = entry
        self._heap = list(live.values())
        heapq.heapify(self._heap)

    def pop_due(self, now: float) -> list[K]:
        due: list[K] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if self.armed.get(key) == deadline:
                del self.armed[key]
                due.append(key)
        if due:
            self._find_earliest()
        return due

    def next_deadline(self) -> float | None:
        return self.earliest

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale ones included (bounded by about twice the armed keys)."""
        return len(self._heap)

    def __len__(self) -> int:
        return len(self.armed)
