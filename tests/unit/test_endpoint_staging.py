"""The decode endpoint's staging ring: heterogeneous TP (prefill TP=2 -> decode TP=1), and small
rooms of one writer (equal TP), which take a region only when one is free at once."""

from __future__ import annotations

import msgspec

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ChecksumChecked,
    ClearRoom,
    DecodeEndpointConfig,
    OpenReceiver,
    PrefillInfo,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    StagingPlaced,
    TimerFired,
    TopologyKnown,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import AbortRequested, PublishPages
from pdflow.core.protocol.messages import AbortAck, PeerId, RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import SendMessage, VerifyChecksums
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.core.resources.page_ledger import PagesFreed

RANK0 = PeerId("127.0.0.1:7000", "p1", 0)
RANK1 = PeerId("127.0.0.1:7001", "p1", 1)
DECODE = PeerId("127.0.0.1:8000", "d1", 0)
INFO = PrefillInfo(
    bootstrap="127.0.0.1:8998", tp_size=2, cp_size=1, pp_size=1, dp_size=1, page_size=16,
    kv_cache_dtype="auto", policy=AllocationPolicy.EARLY,
    ranks=(RegisteredPrefillRank(0, 0, 0, 0, RANK0), RegisteredPrefillRank(0, 0, 1, 0, RANK1)),
)  # fmt: skip
PAGE_BYTES = 1024
ONE_WRITER = PrefillInfo(
    bootstrap="127.0.0.1:8997", tp_size=1, cp_size=1, pp_size=1, dp_size=1, page_size=16,
    kv_cache_dtype="auto", policy=AllocationPolicy.EARLY,
    ranks=(RegisteredPrefillRank(0, 0, 0, 0, RANK0),), staging_slot_bytes=64 * PAGE_BYTES,
)  # fmt: skip


def decode_endpoint(capacity_pages: int, small_room_pages: int = 0,
                    one_writer: PrefillInfo = ONE_WRITER) -> DecodeEndpoint:  # fmt: skip
    endpoint = DecodeEndpoint(
        DecodeEndpointConfig(
            me=DECODE, num_pages=64, num_kv_heads=8, staging_capacity=capacity_pages * PAGE_BYTES,
            staging_page_bytes=PAGE_BYTES, stage_rooms_up_to=small_room_pages * PAGE_BYTES,
        )
    )  # fmt: skip
    endpoint.handle(TopologyKnown(INFO), 0.0)
    endpoint.handle(TopologyKnown(one_writer), 0.0)
    return endpoint


def opened(endpoint: DecodeEndpoint, room: int, info: PrefillInfo = INFO) -> None:
    endpoint.handle(OpenReceiver(room, 1, info.bootstrap), 0.0)


def sent(step: Step) -> list[object]:
    return [o.message for o in step.outputs if isinstance(o, SendMessage)]


def success(endpoint: DecodeEndpoint, room: int, now: float) -> Step:
    for rank in (RANK0, RANK1):
        step = endpoint.handle(
            Received(StatusReport(room, 1, KVPoll.Success, rank, DECODE, checksum=7)), now
        )
    return step


def test_staged_room_publishes_one_region_and_finishes_after_the_scatter() -> None:
    endpoint = decode_endpoint(capacity_pages=8)
    opened(endpoint, 1)
    step = endpoint.handle(PublishPages(1, (10, 11, 12), None), 1.0)
    [placed] = [o for o in step.outputs if isinstance(o, StagingPlaced)]
    assert placed.nbytes == 3 * PAGE_BYTES
    metadata = [m for m in sent(step) if isinstance(m, RoomMetadata)]
    assert {m.prefill for m in metadata} == {RANK0, RANK1}
    assert {m.staging_offset for m in metadata} == {placed.offset}
    last = success(endpoint, 1, 2.0)
    assert any(isinstance(o, VerifyChecksums) for o in last.outputs)
    assert endpoint.summary(1).poll is KVPoll.Transferring  # type: ignore[union-attr]
    endpoint.handle(ChecksumChecked(1, 1, True), 2.1)
    assert endpoint.summary(1).poll is KVPoll.Success  # type: ignore[union-attr]
    assert endpoint.staging is not None and endpoint.staging.snapshot().live == ()


def test_a_busy_ring_defers_publication_until_space_frees() -> None:
    endpoint = decode_endpoint(capacity_pages=4)
    opened(endpoint, 1)
    opened(endpoint, 2)
    endpoint.handle(PublishPages(1, (10, 11, 12), None), 1.0)
    deferred = endpoint.handle(PublishPages(2, (20, 21), None), 1.0)
    assert not [m for m in sent(deferred) if isinstance(m, RoomMetadata)]
    assert endpoint.summary(2).poll is KVPoll.WaitingForInput  # type: ignore[union-attr]
    success(endpoint, 1, 2.0)
    released = endpoint.handle(ChecksumChecked(1, 1, True), 2.1)
    assert [m for m in sent(released) if isinstance(m, RoomMetadata)], "room 2 published now"
    assert endpoint.summary(2).poll is KVPoll.Transferring  # type: ignore[union-attr]


def test_an_oversized_room_fails_with_a_clear_reason_and_frees_its_pages() -> None:
    endpoint = decode_endpoint(capacity_pages=2)
    opened(endpoint, 1)
    step = endpoint.handle(PublishPages(1, (10, 11, 12), None), 1.0)
    summary = endpoint.summary(1)
    assert summary is not None and summary.poll is KVPoll.Failed
    assert "oversized" in summary.reason and "enlarge the staging pool" in summary.reason
    assert any(isinstance(o, PagesFreed) and o.pages == (10, 11, 12) for o in step.outputs)
    assert endpoint.ledger.snapshot().free == 64


def test_a_fenced_room_keeps_its_staging_region_until_every_writer_acks() -> None:
    endpoint = decode_endpoint(capacity_pages=8)
    opened(endpoint, 1)
    endpoint.handle(PublishPages(1, (10, 11), None), 1.0)
    endpoint.handle(RoomCall(1, AbortRequested("client went away")), 1.5)
    endpoint.handle(ClearRoom(1), 1.6)
    assert endpoint.staging is not None and len(endpoint.staging.snapshot().live) == 1
    endpoint.handle(Received(AbortAck(1, 1, RANK0, DECODE)), 2.0)
    assert len(endpoint.staging.snapshot().live) == 1, "rank 1 may still be writing"
    endpoint.handle(Received(AbortAck(1, 1, RANK1, DECODE)), 2.1)
    assert endpoint.staging.snapshot().live == ()
    assert endpoint.ledger.snapshot().free == 64



def test_an_abort_while_verifying_keeps_the_pages_until_the_local_scatter_reports() -> None:
    # Chaos finding 5: the node's checksum task scatters staged slices into the pages; an
    # abort and a clear in those milliseconds must not free them under it.
    endpoint = decode_endpoint(capacity_pages=8)
    opened(endpoint, 1)
    endpoint.handle(PublishPages(1, (10, 11, 12), None), 1.0)
    success(endpoint, 1, 2.0)
    endpoint.handle(RoomCall(1, AbortRequested("client went away")), 2.01)
    summary = endpoint.summary(1)
    assert summary is not None and summary.poll is KVPoll.Failed
    cleared = endpoint.handle(ClearRoom(1), 2.02)
    assert not any(isinstance(o, PagesFreed) for o in cleared.outputs), "the scatter still runs"
    assert endpoint.ledger.snapshot().reserved == 3
    assert endpoint.staging is not None and len(endpoint.staging.snapshot().live) == 1
    endpoint.handle(OpenReceiver(1, 2, INFO.bootstrap), 2.03)  # the room id's next use
    done = endpoint.handle(ChecksumChecked(1, 1, True), 2.04)
    assert [o.pages for o in done.outputs if isinstance(o, PagesFreed)] == [(10, 11, 12)]
    assert endpoint.staging.snapshot().live == ()
    assert endpoint.ledger.snapshot().free == 64
    assert endpoint.summary(1).generation == 2  # type: ignore[union-attr]


def test_a_verified_room_is_released_at_once_when_cleared() -> None:
    endpoint = decode_endpoint(capacity_pages=8)
    opened(endpoint, 1)
    endpoint.handle(PublishPages(1, (10, 11), None), 1.0)
    success(endpoint, 1, 2.0)
    endpoint.handle(ChecksumChecked(1, 1, True), 2.01)
    cleared = endpoint.handle(ClearRoom(1), 2.02)
    assert [o.pages for o in cleared.outputs if isinstance(o, PagesFreed)] == [(10, 11)]


def test_a_room_waiting_for_ring_space_fails_on_the_waiting_budget_and_frees_its_hold() -> None:
    # Chaos finding 4: a fenced room of a dead writer keeps its region for good; a room behind
    # it waited at StagingRing: Assign [tail_too_short] in AWAITING_PAGES with no timer.
    endpoint = decode_endpoint(capacity_pages=4)
    opened(endpoint, 1)
    endpoint.handle(PublishPages(1, (10, 11, 12), None), 1.0)
    endpoint.handle(RoomCall(1, AbortRequested("client went away")), 1.5)  # fenced: no ACK yet
    endpoint.handle(ClearRoom(1), 1.6)
    opened(endpoint, 2)
    deferred = endpoint.handle(PublishPages(2, (20, 21), None), 2.0)
    assert not [m for m in sent(deferred) if isinstance(m, RoomMetadata)]
    budget = endpoint.config.timeouts.waiting_timeout
    assert deferred.timer_at == 2.0 + budget, "the wait for ring space has a deadline"
    expired = endpoint.handle(TimerFired(), 2.0 + budget)
    summary = endpoint.summary(2)
    assert summary is not None and summary.poll is KVPoll.Failed
    assert "waiting for staging-ring space" in summary.reason
    assert [o.pages for o in expired.outputs if isinstance(o, PagesFreed)] == [(20, 21)]
    assert endpoint.staging is not None
    assert [(a.room, a.chunk) for a in endpoint.staging.snapshot().live] == [(1, 1)]
    assert endpoint.ledger.snapshot().quarantined == 3 and endpoint.ledger.snapshot().free == 61


def test_the_quarantine_report_shows_the_staging_bytes_a_fenced_room_holds() -> None:
    endpoint = decode_endpoint(capacity_pages=4)
    opened(endpoint, 1)
    endpoint.handle(PublishPages(1, (10, 11, 12), None), 1.0)
    endpoint.handle(RoomCall(1, AbortRequested("client went away")), 1.5)
    endpoint.handle(ClearRoom(1), 1.6)
    assert endpoint.quarantined_staging_bytes == 3 * PAGE_BYTES
    [held] = endpoint.quarantine(2.0)
    assert held.staging_bytes == 3 * PAGE_BYTES and held.pages == (10, 11, 12)
    endpoint.handle(Received(AbortAck(1, 1, RANK0, DECODE)), 2.0)
    endpoint.handle(Received(AbortAck(1, 1, RANK1, DECODE)), 2.1)
    assert endpoint.quarantined_staging_bytes == 0 and endpoint.quarantine(2.2) == ()


# ---- small rooms of one writer (stage_rooms_up_to) ---------------------------------------------
def publish_small(endpoint: DecodeEndpoint, room: int, pages: tuple[int, ...],
                  now: float) -> Step:  # fmt: skip
    opened(endpoint, room, ONE_WRITER)
    return endpoint.handle(PublishPages(room, pages, None), now)


def placed(step: Step) -> list[StagingPlaced]:
    return [o for o in step.outputs if isinstance(o, StagingPlaced)]


def metadata(step: Step) -> RoomMetadata:
    [found] = [m for m in sent(step) if isinstance(m, RoomMetadata)]
    return found


def small_success(endpoint: DecodeEndpoint, room: int, now: float) -> Step:
    return endpoint.handle(Received(StatusReport(room, 1, KVPoll.Success, RANK0, DECODE)), now)


def test_a_small_room_is_staged_and_finishes_after_its_scatter() -> None:
    endpoint = decode_endpoint(capacity_pages=8, small_room_pages=4)
    step = publish_small(endpoint, 1, (10, 11, 12), 1.0)
    [region] = placed(step)
    assert region.nbytes == 3 * PAGE_BYTES
    assert metadata(step).staging_offset == region.offset
    last = small_success(endpoint, 1, 2.0)
    assert any(isinstance(o, VerifyChecksums) for o in last.outputs), "the scatter is asked for"
    assert endpoint.summary(1).poll is KVPoll.Transferring  # type: ignore[union-attr]
    endpoint.handle(ChecksumChecked(1, 1, True), 2.1)
    assert endpoint.summary(1).poll is KVPoll.Success  # type: ignore[union-attr]
    assert endpoint.staging is not None and endpoint.staging.snapshot().live == ()


def test_a_room_over_the_limit_is_written_directly_and_needs_no_scatter() -> None:
    endpoint = decode_endpoint(capacity_pages=8, small_room_pages=2)
    step = publish_small(endpoint, 1, (10, 11, 12), 1.0)
    assert placed(step) == [] and metadata(step).staging_offset is None
    last = small_success(endpoint, 1, 2.0)
    assert not any(isinstance(o, VerifyChecksums) for o in last.outputs)
    assert endpoint.summary(1).poll is KVPoll.Success  # type: ignore[union-attr]


def test_no_limit_means_no_small_room_staging() -> None:
    endpoint = decode_endpoint(capacity_pages=8)
    step = publish_small(endpoint, 1, (10,), 1.0)
    assert placed(step) == [] and metadata(step).staging_offset is None


def test_a_small_room_is_staged_only_for_a_prefill_whose_slot_holds_it() -> None:
    # A writer that declared no slot (SGLang's own prefill, or a device-memory one without
    # staging memory) would write the pages directly, and the ring's scatter would then
    # overwrite them; one whose slot is smaller than the room could not gather it.
    undeclared = msgspec.structs.replace(ONE_WRITER, staging_slot_bytes=0)
    endpoint = decode_endpoint(capacity_pages=8, small_room_pages=4, one_writer=undeclared)
    step = publish_small(endpoint, 1, (10,), 1.0)
    assert placed(step) == [] and metadata(step).staging_offset is None
    small = msgspec.structs.replace(ONE_WRITER, staging_slot_bytes=2 * PAGE_BYTES)
    endpoint = decode_endpoint(capacity_pages=8, small_room_pages=4, one_writer=small)
    assert placed(publish_small(endpoint, 1, (10, 11, 12), 1.0)) == [], "3 pages > a 2-page slot"
    assert len(placed(publish_small(endpoint, 2, (20, 21), 1.0))) == 1, "2 pages fit it"


def test_a_small_room_never_waits_for_ring_space() -> None:
    # Room 1 holds the whole ring; room 2's region would overlap it: it is written directly
    # at once (published, no StagingWait), and the region it was assigned is handed back.
    endpoint = decode_endpoint(capacity_pages=3, small_room_pages=4)
    assert len(placed(publish_small(endpoint, 1, (10, 11, 12), 1.0))) == 1
    second = publish_small(endpoint, 2, (20, 21), 1.0)
    assert placed(second) == [] and metadata(second).staging_offset is None
    assert endpoint.summary(2).poll is KVPoll.Transferring  # type: ignore[union-attr]
    assert endpoint.staging is not None
    assert [live.room for live in endpoint.staging.snapshot().live] == [1]
    small_success(endpoint, 2, 2.0)
    assert endpoint.summary(2).poll is KVPoll.Success  # type: ignore[union-attr]


def test_a_fenced_small_room_pins_a_region_but_later_small_rooms_still_run() -> None:
    # The hazard staging brings: a region held for a writer that may still write. A small room
    # behind it is written directly rather than waiting on the fence.
    endpoint = decode_endpoint(capacity_pages=4, small_room_pages=4)
    publish_small(endpoint, 1, (10, 11), 1.0)
    endpoint.handle(RoomCall(1, AbortRequested("client went away")), 1.5)
    endpoint.handle(ClearRoom(1), 1.6)
    assert endpoint.staging is not None and len(endpoint.staging.snapshot().live) == 1
    later = publish_small(endpoint, 2, (20, 21, 22), 2.0)
    assert placed(later) == [] and metadata(later).staging_offset is None
    small_success(endpoint, 2, 3.0)
    assert endpoint.summary(2).poll is KVPoll.Success  # type: ignore[union-attr]
    endpoint.handle(Received(AbortAck(1, 1, RANK0, DECODE)), 4.0)
    assert endpoint.staging.snapshot().live == ()
    assert len(placed(publish_small(endpoint, 3, (30,), 5.0))) == 1, "the ring is free again"


def test_a_watermark_advance_visits_only_the_rooms_it_frees() -> None:
    # An advance retried every room waiting for ring space: O(waiting) ring transitions per
    # advance (2,000 waiting rooms: 4,000 transitions to place the four it freed).
    waiting = 2000
    endpoint = DecodeEndpoint(
        DecodeEndpointConfig(
            me=DECODE, num_pages=waiting + 4, num_kv_heads=8, staging_capacity=4 * PAGE_BYTES,
            staging_page_bytes=PAGE_BYTES,
        )
    )  # fmt: skip
    endpoint.handle(TopologyKnown(INFO), 0.0)
    opened(endpoint, 0)
    endpoint.handle(PublishPages(0, (0, 1, 2, 3), None), 1.0)  # the whole ring, round 0
    for room in range(1, waiting + 1):  # one page each: rounds 1, 2, ... four rooms a round
        opened(endpoint, room)
        endpoint.handle(PublishPages(room, (room + 3,), None), 1.0)
    assert len(endpoint.waiting_for_staging) == waiting
    success(endpoint, 0, 2.0)
    freed = endpoint.handle(ChecksumChecked(0, 1, True), 2.1)
    placed = [o.room for o in freed.outputs if isinstance(o, StagingPlaced)]
    assert placed == [1, 2, 3, 4], "round 1 is free once round 0 is, in room id order"
    ring_transitions = [f for f in freed.fired if f.machine == "StagingRing"]
    assert len(ring_transitions) == 1 + 2 * len(placed), "the free, then each freed room's"
    ring = endpoint.staging
    assert ring is not None and len(endpoint.waiting_for_staging) == waiting - 4
    still_blocked = [ring.live[(room, 1)] for room in endpoint.waiting_for_staging]
    assert not any(ring.is_ready(a.offset, a.round, a.end) for a in still_blocked)
