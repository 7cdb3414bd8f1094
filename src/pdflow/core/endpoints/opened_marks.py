"""The prefill's opened high-water marks: per room id, the highest generation the engine opened.

A mark is what makes a late message for a finished generation stale (REMOVED: metadata dropped,
an ABORT ACKed and kept nowhere) instead of new. Under SGLang every request has its own random
room id, so keeping one mark per room id ever opened grows with every request. The marks are
kept in opening order, and past ``capacity`` the least recently opened room id whose endpoint
holds nothing of it (no hosted or draining room, no pending record) is forgotten.

Forgetting is safe: a forgotten room id reads as never opened, so a late message for one of its
finished generations is taken as one for a generation not opened yet. Its metadata is parked
and expires; its ABORT is ACKed (true: nothing of it can write any more) and its cancel floor is
kept under ``max_pending_room_ids``. Neither can write: the engine opens each generation of a
room id once, and a later open of the room id drops what was parked for an earlier generation.
A room id with a pending record (a cancel ACKed before its generation opened) is never
forgotten: the engine may open that older generation after a newer one, and only the mark
tells that open apart from a new room id's (it is refused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

NONE = -(2**63)
"""Below every generation (an int64 on the wire): "no generation yet"."""


class OpenedMarks:
    def __init__(self, capacity: int, holds: Callable[[int], bool]) -> None:
        if capacity < 1:
            raise ValueError(f"max_finished_room_ids must be at least 1, got {capacity}")
        self.capacity = capacity
        self._holds = holds
        """Whether the endpoint still holds something of a room id (its mark is then kept)."""
        self._marks: OrderedDict[int, int] = OrderedDict()
        self.forgotten = 0

    def get(self, room: int, default: int = NONE) -> int:
        return self._marks.get(room, default)

    def opened(self, room: int, generation: int) -> None:
        """The engine opened ``generation`` of ``room``: raise its mark, forget the oldest."""
        self._marks[room] = generation
        self._marks.move_to_end(room)
        # Each pass forgets or moves on; a held room id goes to the back (it was opened longer
        # ago than the rest, but must stay), at most once per entry per call.
        for _ in range(len(self._marks)):
            if len(self._marks) <= self.capacity:
                return
            oldest = next(iter(self._marks))
            if self._holds(oldest):
                self._marks.move_to_end(oldest)
                continue
            del self._marks[oldest]
            self.forgotten += 1

    def __len__(self) -> int:
        return len(self._marks)

    def __contains__(self, room: object) -> bool:
        return room in self._marks
