"""The fake transport moves real bytes and catches every write into a page not owned, and every
write out of a source page its room no longer holds."""

from __future__ import annotations

import pytest

from pdflow.core.protocol.messages import PeerId
from pdflow.sim.transport import SEGMENT_BYTES, FakeTransport, Write, source_content

WRITER = PeerId("p:1", "inc", 0)
TARGET = PeerId("d:1", "inc", 0)


SOURCES = (10, 11, 12, 13)
"""The source pages the writer's engine gave room 5/1."""


def make(owner: dict[int, tuple[int, int]]) -> FakeTransport:
    transport = FakeTransport(2, 4, lambda rank, page: owner.get(page))
    transport.decode_started(0, TARGET)
    transport.prefill_started(WRITER, 16)
    transport.fill_sources(WRITER, SOURCES, 5, 1, 0)
    return transport


def write(transport: FakeTransport, pages: tuple[int, ...], segment: int = 1) -> Write:
    src = SOURCES[: len(pages)]
    w = Write(transport.next_write_id(), 0, WRITER, 0, TARGET, 5, 1, 0, pages, segment, src)
    transport.add(w)
    return w


def test_landing_copies_bytes_into_the_writer_segment() -> None:
    transport = make({2: (5, 1), 3: (5, 1)})
    w = write(transport, (2, 3))
    assert transport.land(w)
    assert transport.read_segment(0, 3, 1) == source_content(5, 1, 0, 1)
    assert transport.read_segment(0, 3, 0) == bytes(SEGMENT_BYTES)
    assert transport.checksum_of(0, (2, 3), 1) == w.checksum
    assert not transport.violations


def test_write_into_a_page_the_room_does_not_own_is_recorded() -> None:
    transport = make({2: (5, 1), 3: (9, 1)})
    transport.land(write(transport, (2, 3)))
    (uaf,) = transport.violations
    assert (uaf.page, uaf.owner) == (3, (9, 1))
    assert "owned by room 9/1" in uaf.describe()


def test_fenced_writer_and_restarted_target_never_land() -> None:
    transport = make({0: (5, 1)})
    closed = write(transport, (0,))
    transport.fence(0, WRITER)
    assert not transport.land(closed)
    transport.lift_fence(0, WRITER)
    assert not transport.land(closed), "a write started before the fence stays refused"
    assert transport.land(write(transport, (0,))), "one started after the lift lands"
    transport2 = make({0: (5, 1)})
    stale = write(transport2, (0,))
    transport2.decode_started(0, PeerId("d:1", "new", 0))
    assert not transport2.land(stale)
    assert transport2.read_segment(0, 0, 1) == bytes(SEGMENT_BYTES)


def test_partial_and_corrupted_landings() -> None:
    transport = make({0: (5, 1), 1: (5, 1)})
    w = write(transport, (0, 1))
    assert transport.land(w, pages=1) and not w.landed
    assert transport.read_segment(0, 1, 1) == bytes(SEGMENT_BYTES)
    corrupt = write(transport, (0, 1))
    transport.land(corrupt, corrupt=True)
    assert transport.checksum_of(0, (0, 1), 1) != corrupt.checksum


@pytest.mark.invariant("no_source_use_after_free")
def test_a_write_reads_its_sources_when_it_lands_and_a_freed_source_is_recorded() -> None:
    """The bytes move at landing time: a source page the engine freed and handed to another
    room before the write landed is read as it is then, and recorded."""
    transport = make({0: (5, 1), 1: (5, 1)})
    w = write(transport, (0, 1))
    transport.release_sources(WRITER, SOURCES[:2])
    transport.fill_sources(WRITER, (SOURCES[1],), 7, 2, 0)  # reused for room 7/2's first page
    assert transport.land(w)
    assert transport.read_segment(0, 1, 1) == source_content(7, 2, 0, 0)
    assert w.checksum == transport.checksum_of(0, (0, 1), 1), "it covers what was moved"
    freed, reused = transport.source_violations
    assert (freed.page, freed.holder) == (SOURCES[0], None)
    assert (reused.page, reused.holder) == (SOURCES[1], (7, 2))
    assert "held by room 7/2" in reused.describe() and "nobody (free)" in freed.describe()
    assert not transport.violations, "the decode pages were the room's own"


@pytest.mark.invariant("no_source_use_after_free")
def test_a_partial_landing_reads_what_it_moves_at_landing_time_and_only_that() -> None:
    """A failed write lands in part: the pages it moved are read when it lands, so a source
    page freed and reused before is read as it is then and recorded; the pages it never moved
    are never read, freed or not."""
    transport = make({0: (5, 1), 1: (5, 1), 2: (5, 1)})
    w = write(transport, (0, 1, 2))
    transport.release_sources(WRITER, SOURCES[:3])
    transport.fill_sources(WRITER, (SOURCES[0],), 7, 2, 0)  # reused for room 7/2
    assert transport.land(w, pages=2) and not w.landed
    assert w.moved == [source_content(7, 2, 0, 0), source_content(5, 1, 0, 1)]
    assert transport.read_segment(0, 0, 1) == source_content(7, 2, 0, 0)
    assert transport.read_segment(0, 2, 1) == bytes(SEGMENT_BYTES), "never moved"
    assert w.checksum == transport.checksum_of(0, (0, 1), 1), "it covers what was moved"
    reused, freed = transport.source_violations
    assert (reused.page, reused.holder) == (SOURCES[0], (7, 2))
    assert (freed.page, freed.holder) == (SOURCES[1], None)
    assert transport.sources_checked == 2, "the third page was neither read nor checked"


def test_a_write_that_never_moves_reads_nothing() -> None:
    transport = make({0: (5, 1)})
    w = write(transport, (0,))
    transport.fence(0, WRITER)
    transport.release_sources(WRITER, SOURCES[:1])
    assert not transport.land(w)
    assert not transport.source_violations and w.moved == []
