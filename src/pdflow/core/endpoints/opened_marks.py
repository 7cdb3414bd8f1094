"""The prefill's opened high-water marks: per room id, the highest generation the engine opened.

A mark is what makes a late message for a finished generation stale (REMOVED: metadata dropped,
an ABORT ACKed) instead of new, and what refuses the engine's late open of a generation below
it. Under SGLang every request has its own random room id, so keeping one mark per room id ever
opened grows with every request. The marks are kept in opening order, and past ``capacity`` the
least recently opened room id whose endpoint holds nothing of it (no hosted or draining room, no
pending record) is forgotten. A room id found held on the way is parked off that order (it
cannot be forgotten yet) and rechecked a few at a time on later opens, going back to the front
once it holds nothing: each open costs O(1) amortized however many room ids are held, where
scanning past every held one cost O(held) per open once more than ``capacity`` were held
(100,000 rooms in flight: quadratic).

Forgetting is safe: a forgotten room id reads as never opened, so a late message for one of its
finished generations is taken as one for a generation not opened yet. Its metadata is parked
and expires; its ABORT is ACKed and its cancel floor is kept under ``max_pending_room_ids``, so
that generation fails at once if it ever opens. Neither can write: the engine opens each
generation of a room id once, and a later open of the room id drops what was parked for an
earlier generation. What forgetting loses is the refusal of a late open below the mark: the
engine may open an older generation after a newer one, and only the mark tells that open apart
from a new room id's. So a room id with a pending record is never forgotten, and every ABORT
ACKed for a generation below the mark (one that may never have opened; the mark's own
generation did) is kept as such a record (prefill_slots.py), else not ACKed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

NONE = -(2**63)
"""Below every generation (an int64 on the wire): "no generation yet"."""


_RECHECKS_PER_OPEN = 2
"""Parked room ids rechecked per open: more than the one a single open can park, so the parked
set drains while it grows by at most one per open."""


class OpenedMarks:
    def __init__(self, capacity: int, holds: Callable[[int], bool]) -> None:
        if capacity < 1:
            raise ValueError(f"max_finished_room_ids must be at least 1, got {capacity}")
        self.capacity = capacity
        self._holds = holds
        """Whether the endpoint still holds something of a room id (its mark is then kept)."""
        self._marks: dict[int, int] = {}
        self._queue: OrderedDict[int, None] = OrderedDict()
        """Room ids that may be forgotten, least recently opened first."""
        self._parked: OrderedDict[int, None] = OrderedDict()
        """Room ids found held when their turn came; back to the queue once they hold nothing."""
        self.forgotten = 0

    def get(self, room: int, default: int = NONE) -> int:
        return self._marks.get(room, default)

    def opened(self, room: int, generation: int) -> None:
        """The engine opened ``generation`` of ``room``: raise its mark, forget the oldest."""
        self._marks[room] = generation
        self._parked.pop(room, None)
        self._queue.pop(room, None)
        if self._parked:
            self._unpark(_RECHECKS_PER_OPEN)
        while len(self._marks) > self.capacity and self._queue:
            oldest = next(iter(self._queue))
            del self._queue[oldest]
            if self._holds(oldest):
                self._parked[oldest] = None
                continue
            del self._marks[oldest]
            self.forgotten += 1
        # Queued only now: the room id being opened is not hosted yet, but holds its room from
        # this step on, so it is never the one forgotten (every other one may be held).
        self._queue[room] = None

    def _unpark(self, budget: int) -> None:
        for _ in range(min(budget, len(self._parked))):
            room = next(iter(self._parked))
            if self._holds(room):
                self._parked.move_to_end(room)
                continue
            del self._parked[room]
            self._queue[room] = None
            self._queue.move_to_end(room, last=False)  # opened long ago: forgotten first

    def __len__(self) -> int:
        return len(self._marks)

    def __contains__(self, room: object) -> bool:
        return room in self._marks
