"""The fake transport moves real bytes and catches every write into a page not owned."""

from __future__ import annotations

from pdflow.core.protocol.messages import PeerId
from pdflow.sim.transport import SEGMENT_BYTES, FakeTransport, Write, source_content

WRITER = PeerId("p:1", "inc", 0)
TARGET = PeerId("d:1", "inc", 0)


def make(owner: dict[int, tuple[int, int]]) -> FakeTransport:
    transport = FakeTransport(2, 4, lambda rank, page: owner.get(page))
    transport.decode_started(0, TARGET)
    return transport


def write(transport: FakeTransport, pages: tuple[int, ...], segment: int = 1) -> Write:
    data = tuple(source_content(5, 1, 0, i) for i in range(len(pages)))
    w = Write(transport.next_write_id(), 0, WRITER, 0, TARGET, 5, 1, 0, pages, segment, data)
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
