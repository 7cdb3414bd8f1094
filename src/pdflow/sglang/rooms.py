"""What the adapter knows of each room, shared between pdflow's loop thread and the scheduler.

pdflow's node events (status, pages released, room closed) arrive on the loop thread; SGLang's
``poll()`` runs on the scheduler thread and must not wait. :class:`RoomBook` is the hand-over:
the loop writes each room's latest facts under one lock, the scheduler reads them without it.
Facts are immutable: an event stores a new snapshot, so a read hands out the stored one instead
of copying it, and one dict read (atomic) sees either the snapshot before a write or the one
after, never a mix; the scheduler polls every room on every tick, far more often than events
come, and the lock was most of a poll's cost.
No SGLang import here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
from msgspec.structs import replace

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import NodeEvent, PagesHeld, PagesReleased, RoomClosed, RoomStatus


class RoomFacts(msgspec.Struct, frozen=True):
    """One room as pdflow reported it (the latest of each kind of event). A Struct rather than
    a dataclass: its ``replace`` is several times cheaper, and the loop makes one per event."""

    poll: KVPoll | None = None
    reason: str = ""
    closed: bool = False
    """The endpoint forgot the room: on the prefill, after ``clear`` once every write drained."""
    released: bool = False
    """Decode: pdflow released the room's pages (``PagesReleased``): no write can land there."""
    held: bool = False
    """Decode: pdflow quarantined the room's pages (``PagesHeld``) until its writers drain."""
    local_error: str = ""
    """A call the adapter made for this room was refused (the reason SGLang gets)."""
    pages_given: bool = False
    """Decode: this rank's pages went to pdflow (``publish_pages`` queued and not refused).
    Until then no writer can know them, so SGLang may free them whatever the room's state."""
    finished: bool = False
    """SGLang is done with the room (its ``clear``, or the adapter's final Failed): the entry
    goes as soon as pdflow closed the room too, so the book holds only live rooms."""
    bytes_moved: int | None = None
    transfer_s: float | None = None


NOTHING_KNOWN = RoomFacts()


class RoomBook:
    """Thread-safe room facts, fed by node events (locked writes), read by the scheduler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rooms: dict[int, RoomFacts] = {}

    def facts(self, room: int) -> RoomFacts:
        """What is known of ``room`` now (empty facts for an unknown room); never changes."""
        return self._rooms.get(room, NOTHING_KNOWN)  # no lock: see the module docstring

    def reader(self) -> Callable[[int, RoomFacts], RoomFacts]:
        """:meth:`facts` without a Python call: the book's own ``dict.get``, to be called as
        ``read(room, NOTHING_KNOWN)`` (the scheduler's ``poll()`` runs it for every room on
        every tick). The dict is never replaced, so a reader taken once stays current."""
        return self._rooms.get

    def claim(self, room: int) -> bool:
        """Start tracking a new request's room. False, changing nothing, while an earlier
        request with this id is still tracked: both would read and write one entry (pdflow's
        events name the room id and the adapter's fixed generation only), and the earlier
        one's pages could be freed on the newer one's facts."""
        with self._lock:
            if room in self._rooms:
                return False
            self._rooms[room] = NOTHING_KNOWN
            return True

    def refuse(self, room: int, reason: str, *, pages_taken: bool = True) -> None:
        """Fail the room with ``reason``; ``pages_taken=False`` when the refused call was the
        one that hands pdflow the pages (a refused input changes no state in the core)."""
        with self._lock:
            facts = self._rooms.get(room)
            if facts is None:  # a late refusal for a room already dropped: nothing to fail
                return
            if not facts.local_error:
                facts = replace(facts, local_error=reason)
            if not pages_taken:
                facts = replace(facts, pages_given=False)
            self._rooms[room] = facts

    def give_pages(self, room: int) -> None:
        self._update(room, pages_given=True)

    def release_safe(self, room: int) -> bool:
        """Decode: whether SGLang may free the room's pages now. Yes once pdflow released
        them (every writer drained or was fenced), once the room succeeded (every writer
        reported its writes landed, and none writes again), or if pdflow never had them."""
        return _release_safe(self._rooms.get(room, NOTHING_KNOWN))

    def close(self, room: int) -> None:
        """The room is closed in pdflow (or pdflow never opened it)."""
        with self._lock:
            facts = self._rooms.get(room)
            if facts is not None:  # an entry already dropped is not made again
                self._closed(room, facts)

    def finish(self, room: int) -> None:
        """SGLang is done with the room: the entry goes once pdflow closed it too and no write
        can land in its pages (:meth:`_settle`)."""
        with self._lock:
            facts = self._rooms.get(room)
            if facts is not None:
                self._settle(room, replace(facts, finished=True))

    def __len__(self) -> int:
        return len(self._rooms)

    def _closed(self, room: int, facts: RoomFacts) -> None:
        self._settle(room, replace(facts, closed=True))

    def _settle(self, room: int, facts: RoomFacts) -> None:
        """Store the facts, or drop the entry once SGLang and pdflow are both done with the
        room and its pages are safe to free: an unknown room reads as release-safe, so an
        entry whose pages a write may still reach stays until pdflow releases them."""
        if facts.finished and facts.closed and _release_safe(facts):
            self._rooms.pop(room, None)
        else:
            self._rooms[room] = facts

    def record_transfer(self, room: int, nbytes: int | None, seconds: float | None) -> None:
        self._update(room, bytes_moved=nbytes, transfer_s=seconds)

    def _update(self, room: int, **changes: object) -> None:
        """Change a tracked room's facts; an entry already dropped is not made again (it would
        stay for good, and hold the id against its next request)."""
        with self._lock:
            facts = self._rooms.get(room)
            if facts is not None:
                self._rooms[room] = replace(facts, **changes)

    def apply(self, event: NodeEvent) -> None:
        """Record one node event (called on the loop thread)."""
        room = getattr(event, "room", None)
        if room is None:
            return
        with self._lock:
            facts = self._rooms.get(room)
            if facts is None:
                # An event for a room this process never opened, or already forgot.
                return
            if isinstance(event, RoomStatus):
                facts = replace(facts, poll=event.poll, reason=event.reason or facts.reason)
            elif isinstance(event, PagesReleased):
                self._settle(room, replace(facts, released=True))
                return
            elif isinstance(event, PagesHeld):
                facts = replace(facts, held=True)
            elif isinstance(event, RoomClosed):
                self._closed(room, facts)
                return
            else:
                return
            self._rooms[room] = facts


def _release_safe(facts: RoomFacts) -> bool:
    return facts.released or facts.poll is KVPoll.Success or not facts.pages_given
