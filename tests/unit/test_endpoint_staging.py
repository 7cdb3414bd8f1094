"""Heterogeneous TP through the decode endpoint's staging ring (prefill TP=2 -> decode TP=1)."""

from __future__ import annotations

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


def decode_endpoint(capacity_pages: int) -> DecodeEndpoint:
    endpoint = DecodeEndpoint(
        DecodeEndpointConfig(
            me=DECODE, num_pages=64, num_kv_heads=8, staging_capacity=capacity_pages * PAGE_BYTES,
            staging_page_bytes=PAGE_BYTES,
        )
    )  # fmt: skip
    endpoint.handle(TopologyKnown(INFO), 0.0)
    return endpoint


def opened(endpoint: DecodeEndpoint, room: int) -> None:
    endpoint.handle(OpenReceiver(room, 1, INFO.bootstrap), 0.0)


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
