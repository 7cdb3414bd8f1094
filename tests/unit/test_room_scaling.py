"""Per-room costs do not grow with the number of rooms: counted, never timed.

A release, a fence, writer news, the quarantine gauges and an admission decision must touch
only the rooms they are about, and a room opened on a known topology reuses its resolution.
Each test fills a ledger (deadline queue, admission queue) with thousands of bystanders and
counts how many of them the operation visits.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdflow.core.framework.deadlines import DeadlineQueue
from pdflow.core.protocol.messages import PeerId
from pdflow.core.resources import admission
from pdflow.core.resources.admission import (
    AdmissionBudget,
    AdmissionQueue,
    AdmitRequests,
    EnqueueRequest,
    FinishRequest,
)
from pdflow.core.resources.page_ledger import (
    AckArrived,
    Fence,
    PageLedger,
    ReleaseAfterSuccess,
    Reserve,
    WriterDead,
)

A = PeerId("10.0.0.1:7000", "a1")
B = PeerId("10.0.0.2:7000", "b1")
BYSTANDERS = 2000


class VisitCountingDict(dict[Any, Any]):
    """A dict that counts the entries every full walk over it visits."""

    visited = 0

    def __iter__(self) -> Any:
        VisitCountingDict.visited += len(self)
        return super().__iter__()

    def values(self) -> Any:
        VisitCountingDict.visited += len(self)
        return super().values()

    def items(self) -> Any:
        VisitCountingDict.visited += len(self)
        return super().items()

    def keys(self) -> Any:
        VisitCountingDict.visited += len(self)
        return super().keys()


def _crowded_ledger(fenced: int) -> PageLedger:
    """BYSTANDERS reserved rooms (one page each), then ``fenced`` rooms quarantined on A."""
    ledger = PageLedger(BYSTANDERS + fenced + 1)
    for room in range(BYSTANDERS + fenced):
        ledger.handle(Reserve(room, 0, (room,)), 0.0)
    for room in range(BYSTANDERS, BYSTANDERS + fenced):
        ledger.handle(Fence(room, 0, (A,)), float(room))
    for name in ("_rooms", "_fenced"):
        if hasattr(ledger, name):
            setattr(ledger, name, VisitCountingDict(getattr(ledger, name)))
    VisitCountingDict.visited = 0
    return ledger


def test_a_release_and_the_quarantine_gauges_visit_no_other_room() -> None:
    ledger = _crowded_ledger(fenced=3)
    ledger.handle(ReleaseAfterSuccess(7, 0), 10_000.0)
    ledger.handle(AckArrived(BYSTANDERS, 0, A), 10_000.0)  # frees the oldest fenced room
    pages, oldest = ledger.quarantined_pages, ledger.oldest_fenced_at()
    assert VisitCountingDict.visited == 0
    # The O(1) figures agree with the full report.
    report = ledger.report(10_000.0)
    assert pages == sum(len(q.pages) for q in report) == 2
    assert oldest == float(BYSTANDERS + 1) == 10_000.0 - report[0].age_s
    assert ledger.snapshot().quarantined == 2


def test_writer_news_visits_only_the_fenced_rooms() -> None:
    ledger = _crowded_ledger(fenced=3)
    ledger.handle(WriterDead(B), 10_000.0)  # B writes into nothing fenced
    assert VisitCountingDict.visited <= 3
    assert ledger.quarantined_pages == 3


def test_the_oldest_fence_follows_releases_in_any_order() -> None:
    ledger = PageLedger(8)
    for room, at in ((1, 5.0), (2, 1.0), (3, 3.0)):
        ledger.handle(Reserve(room, 0, (room,)), 0.0)
        ledger.handle(Fence(room, 0, (A,)), at)
    assert ledger.oldest_fenced_at() == 1.0
    ledger.handle(AckArrived(2, 0, A), 6.0)
    assert ledger.oldest_fenced_at() == 3.0
    ledger.handle(AckArrived(3, 0, A), 6.0)
    ledger.handle(AckArrived(1, 0, A), 6.0)
    assert ledger.oldest_fenced_at() is None
    assert ledger.quarantined_pages == 0


def test_the_fence_time_heap_stays_bounded_over_many_fenced_rooms() -> None:
    ledger = PageLedger(4)
    for room in range(5000):
        ledger.handle(Reserve(room, 0, (0,)), float(room))
        ledger.handle(Fence(room, 0, (A,)), float(room))
        ledger.handle(AckArrived(room, 0, A), float(room))
        assert len(ledger._fence_times) <= 2 * (len(ledger._fenced) + 1) + 64


def test_the_deadline_heap_stays_within_a_constant_factor_of_the_armed_keys() -> None:
    queue: DeadlineQueue[int] = DeadlineQueue()
    for room in range(10_000):
        queue.arm(room, 1000.0 + room)  # opened: a waiting deadline far ahead
        queue.arm(room, 2000.0 + room)  # re-armed once (a transfer deadline)
        if room >= 10:
            queue.arm(room - 10, None)  # closed long before its deadline
        assert queue.heap_size <= 2 * (len(queue) + 1) + 64
    assert len(queue) == 10
    assert queue.next_deadline() == 2000.0 + 9_990
    assert queue.pop_due(1e9) == list(range(9_990, 10_000))


def test_an_admission_decision_does_not_walk_the_admitted_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = AdmissionBudget(pool_pages=3 * BYSTANDERS, page_size=16, reserve_tokens=16,
                             clip_max_new=32)  # fmt: skip
    queue = AdmissionQueue(budget)
    for index in range(BYSTANDERS):
        queue.handle(EnqueueRequest(f"r{index}", 16, 32), 0.0)
        queue.handle(AdmitRequests(), 0.0)
    assert len(queue.admitted) == BYSTANDERS
    calls = 0
    real = admission.footprint

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(admission, "footprint", counted)
    queue.handle(FinishRequest("r0"), 1.0)
    queue.handle(EnqueueRequest("late", 16, 32), 1.0)
    queue.handle(AdmitRequests(), 1.0)
    assert calls <= 10
    assert queue.largest_growth == 1
    assert queue.reserved_pages == 2 * (len(queue.admitted))


def test_a_topology_is_resolved_once_per_dp_group_not_once_per_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Opening rooms on a known prefill instance reuses its resolved peers: the rank mapping is
    worked out once per prefill DP group, and every room still gets its own group's ranks."""
    from pdflow.core.endpoints import decode_endpoint
    from pdflow.core.endpoints.endpoint_io import (
        DecodeEndpointConfig,
        OpenReceiver,
        PrefillInfo,
        RegisteredPrefillRank,
        TopologyKnown,
    )
    from pdflow.core.protocol.policy import AllocationPolicy

    calls = 0
    original = decode_endpoint.resolve_rank_mapping

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_endpoint, "resolve_rank_mapping", counting)
    ranks = tuple(
        RegisteredPrefillRank(dp=dp, cp=0, tp=0, pp=0, peer=PeerId(f"10.0.1.{dp}:7000", "p1"))
        for dp in range(2)
    )
    info = PrefillInfo("10.0.1.0:8998", 1, 1, 1, 2, 16, "auto", AllocationPolicy.EARLY, ranks)
    endpoint = decode_endpoint.DecodeEndpoint(
        DecodeEndpointConfig(me=PeerId("10.0.2.1:7100", "d1"), num_pages=64, page_size=16)
    )
    endpoint.handle(TopologyKnown(info), 0.0)
    for room in range(200):
        endpoint.handle(OpenReceiver(room, 0, info.bootstrap), 0.0)
    assert calls == 2, f"{calls} rank mappings resolved for 200 rooms in 2 DP groups"
    for room in range(200):
        assert endpoint.writers_of(room) == (ranks[room % 2].peer,)


def test_opens_ask_about_a_bounded_number_of_held_room_ids_however_many_are_held() -> None:
    # More room ids held (rooms in flight) than the marks' capacity: an open must not walk past
    # every held one to find one it may forget (100,000 rooms in flight made opening quadratic).
    # Each room id is asked about O(1) times per open on average (amortized), never O(held).
    from pdflow.core.endpoints.opened_marks import OpenedMarks

    held: set[int] = set()
    asked = [0]

    def holds(room: int) -> bool:
        asked[0] += 1
        return room in held

    marks = OpenedMarks(capacity=16, holds=holds)
    for room in range(BYSTANDERS):
        held.add(room)
        marks.opened(room, 1)
    assert asked[0] <= 4 * BYSTANDERS, f"{BYSTANDERS} opens asked {asked[0]} times"
    assert len(marks) == BYSTANDERS  # every held mark is kept
    # Once they hold nothing, later opens forget them again, down to the capacity.
    held.clear()
    asked[0] = 0
    for room in range(BYSTANDERS, 3 * BYSTANDERS):
        marks.opened(room, 1)
    assert asked[0] <= 4 * 2 * BYSTANDERS, f"{2 * BYSTANDERS} opens asked {asked[0]} times"
    assert len(marks) == 16 and marks.forgotten == 3 * BYSTANDERS - 16


def test_a_prefill_complete_step_visits_no_other_room() -> None:
    # Under prefill_complete every prefill step asked the ready table for its next expiry by
    # walking every room it held: each step cost O(rooms open).
    from pdflow.core.endpoints.endpoint_io import (
        ClearRoom,
        OpenRoom,
        PrefillEndpointConfig,
        Received,
        RoomCall,
        TimerFired,
    )
    from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
    from pdflow.core.protocol.inputs import AbortRequested
    from pdflow.core.protocol.messages import BootstrapRequest
    from pdflow.core.protocol.policy import AllocationPolicy

    endpoint = PrefillEndpoint(
        PrefillEndpointConfig(me=A, policy=AllocationPolicy.PREFILL_COMPLETE)
    )
    for room in range(BYSTANDERS):
        endpoint.handle(OpenRoom(room, 0), 0.0)
    table = endpoint.ready_table
    assert table is not None
    table._rooms = VisitCountingDict(table._rooms)
    VisitCountingDict.visited = 0
    late = BootstrapRequest(room=BYSTANDERS, generation=0, decode=B, prefill=A)
    endpoint.handle(Received(late), 1.0)  # an early bootstrap: an ownerless room that expires
    endpoint.handle(RoomCall(3, AbortRequested("gave up")), 2.0)
    endpoint.handle(ClearRoom(3), 2.0)  # failed and cleared: a tombstone that expires
    step = endpoint.handle(TimerFired(), 3.0)
    assert VisitCountingDict.visited == 0
    assert step.timer_at == 1.0 + table.ttl_s
    # The ownerless room still expires exactly at its deadline, and only then.
    endpoint.handle(TimerFired(), 1.0 + table.ttl_s)
    assert table.state_of(BYSTANDERS, 0).name == "ABSENT"
    assert table.timer_at() == 2.0 + table.ttl_s, "room 3's tombstone expires next"


def test_opens_do_not_walk_the_rooms_that_drain() -> None:
    # Whether a room id is held (its opened mark must be kept) was answered by walking every
    # room cleared with writes in flight: past max_finished_room_ids each open cost O(draining).
    from pdflow.core.endpoints.endpoint_io import (
        ClearRoom,
        OpenRoom,
        PrefillEndpointConfig,
        Received,
        RoomCall,
        TransferCompleted,
    )
    from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
    from pdflow.core.protocol.inputs import AbortRequested, InitTransfer, SendChunk
    from pdflow.core.protocol.messages import RoomMetadata
    from pdflow.core.protocol.outputs import StartTransfer

    endpoint = PrefillEndpoint(PrefillEndpointConfig(me=A, max_finished_room_ids=16))
    writes = {}
    for room in range(BYSTANDERS):  # each cleared with its one write in flight
        metadata = RoomMetadata(
            room=room, generation=0, decode=B, prefill=A, session_id="s", dst_pages=(0,),
            aux_index=None, required_dst_info_num=1,
        )  # fmt: skip
        endpoint.handle(OpenRoom(room, 0), 0.0)
        endpoint.handle(Received(metadata), 0.0)
        endpoint.handle(RoomCall(room, InitTransfer(1)), 0.0)
        step = endpoint.handle(RoomCall(room, SendChunk((5,), is_last=True)), 0.0)
        (writes[room],) = [o.seq for o in step.outputs if isinstance(o, StartTransfer)]
        endpoint.handle(RoomCall(room, AbortRequested("gave up")), 0.0)
        endpoint.handle(ClearRoom(room), 0.0)
    endpoint.draining = VisitCountingDict(endpoint.draining)
    VisitCountingDict.visited = 0
    for room in range(BYSTANDERS, BYSTANDERS + 100):
        endpoint.handle(OpenRoom(room, 0), 1.0)
        endpoint.handle(RoomCall(room, AbortRequested("gave up")), 1.0)
        endpoint.handle(ClearRoom(room), 1.0)
    assert VisitCountingDict.visited == 0
    # A room id that drains keeps its mark; once drained it may be forgotten again.
    assert all(room in endpoint.opened for room in range(BYSTANDERS))
    assert len(endpoint.opened) <= BYSTANDERS + 16
    endpoint.handle(TransferCompleted(0, 0, writes[0], ok=False, reason="x"), 2.0)
    for room in range(BYSTANDERS + 100, 2 * BYSTANDERS):  # time to recheck every held one
        endpoint.handle(OpenRoom(room, 0), 2.0)
        endpoint.handle(RoomCall(room, AbortRequested("gave up")), 2.0)
        endpoint.handle(ClearRoom(room), 2.0)
    assert 0 not in endpoint.opened and 1 in endpoint.opened
