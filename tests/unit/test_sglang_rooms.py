"""RoomBook, the hand-over of room facts from pdflow's loop thread to SGLang's scheduler: a
poll reads a snapshot that later events never change, without copying it on every read."""

from __future__ import annotations

import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import RoomClosed, RoomStatus
from pdflow.sglang.rooms import NOTHING_KNOWN, RoomBook


def test_polling_reads_one_snapshot_until_an_event_replaces_it() -> None:
    book = RoomBook()
    assert book.claim(7)
    first = book.facts(7)
    # The scheduler polls every room on every tick: no copy per read.
    assert book.facts(7) is first
    book.apply(RoomStatus(rank=0, room=7, generation=0, poll=KVPoll.Transferring))
    book.apply(RoomStatus(rank=0, room=7, generation=0, poll=KVPoll.Success, reason="done"))
    book.apply(RoomClosed(rank=0, room=7, generation=0))
    now = book.facts(7)
    assert (now.poll, now.reason, now.closed) == (KVPoll.Success, "done", True)
    # What a reader already holds is never changed under it by the loop thread.
    assert (first.poll, first.reason, first.closed) == (None, "", False)
    with pytest.raises(AttributeError):  # frozen
        now.closed = False  # type: ignore[misc]


def test_refusal_keeps_the_first_reason_and_events_of_unknown_rooms_are_ignored() -> None:
    book = RoomBook()
    book.refuse(3, "before the claim")  # an unknown room: nothing to fail, nothing made
    assert len(book) == 0 and book.claim(3)
    book.refuse(3, "first")
    book.refuse(3, "second")
    assert book.facts(3).local_error == "first"
    book.apply(RoomStatus(rank=0, room=4, generation=0, poll=KVPoll.Failed))
    assert book.facts(4).poll is None  # never opened here: nothing recorded
    book.record_transfer(3, 4096, 0.5)
    assert (book.facts(3).bytes_moved, book.facts(3).transfer_s) == (4096, 0.5)
    book.finish(3)
    book.close(3)  # SGLang and pdflow both done, no pages given: the entry goes
    assert book.facts(3).local_error == "" and len(book) == 0


def test_a_reader_taken_before_the_room_opened_sees_every_later_snapshot() -> None:
    book = RoomBook()
    read = book.reader()  # the adapter's senders and receivers take it once, when made
    assert read(5, NOTHING_KNOWN) is NOTHING_KNOWN
    assert book.claim(5)
    book.apply(RoomStatus(rank=0, room=5, generation=0, poll=KVPoll.WaitingForInput))
    assert read(5, NOTHING_KNOWN) is book.facts(5)
    assert read(5, NOTHING_KNOWN).poll is KVPoll.WaitingForInput
    book.refuse(5, "refused")
    assert read(5, NOTHING_KNOWN).local_error == "refused"
    book.finish(5)
    book.apply(RoomClosed(rank=0, room=5, generation=0))
    assert read(5, NOTHING_KNOWN) is NOTHING_KNOWN
