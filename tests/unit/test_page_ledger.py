"""PageLedger: every cell of its table, and the page-reuse bugs it exists to rule out."""

from collections.abc import Callable

import pytest

from pdflow.core.framework.errors import InvalidInput, LocalProtocolError, ProtocolError
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.messages import PeerId
from pdflow.core.resources.page_ledger import (
    PAGE_LEDGER_TABLE,
    AckArrived,
    Fence,
    PageLedger,
    PagePool,
    PagesFreed,
    PagesQuarantined,
    ReleaseAfterSuccess,
    ReleaseUnpublished,
    Reserve,
    RoomPages,
    RoomPagesState,
    SessionClosed,
    SessionRetired,
    VerifyDone,
    VerifyStarted,
    WriterDead,
    WriterHealth,
    WriterReadmitted,
)

A = PeerId("10.0.0.1:7000", "a1")
B = PeerId("10.0.0.2:7000", "b1")
POOL = 8


# ---- exhaustive cells --------------------------------------------------------------------------
def _machine_in(state: RoomPagesState) -> tuple[RoomPages, PagePool]:
    pool = PagePool(POOL)
    machine = RoomPages(1, 1, pool, WriterHealth())
    if state is not RoomPagesState.FREE:
        machine.fire(Reserve(1, 1, (0, 1)), 0.0)
    if state is RoomPagesState.FENCED:
        machine.fire(Fence(1, 1, (A, B)), 0.0)
    if state in (RoomPagesState.VERIFYING, RoomPagesState.RELEASING):
        machine.fire(VerifyStarted(1, 1), 0.0)
    if state is RoomPagesState.RELEASING:
        machine.fire(ReleaseAfterSuccess(1, 1), 0.0)
    assert machine.state is state
    return machine, pool


SAMPLES: dict[str, Input] = {
    "Reserve": Reserve(1, 1, (2, 3)),
    "VerifyStarted": VerifyStarted(1, 1),
    "VerifyDone": VerifyDone(1, 1),
    "ReleaseAfterSuccess": ReleaseAfterSuccess(1, 1),
    "ReleaseUnpublished": ReleaseUnpublished(1, 1),
    "Fence": Fence(1, 1, (A,)),
    "AckArrived": AckArrived(1, 1, A),
    "WriterDead": WriterDead(A),
    "SessionClosed": SessionClosed(A),
    "SessionRetired": SessionRetired("10.0.1.1:9000"),
    "WriterReadmitted": WriterReadmitted(A),
}


def test_samples_cover_every_input() -> None:
    assert set(SAMPLES) == set(PAGE_LEDGER_TABLE.inputs)


@pytest.mark.parametrize("state", list(RoomPagesState), ids=lambda s: s.name)
@pytest.mark.parametrize("on", PAGE_LEDGER_TABLE.inputs)
def test_every_cell(state: RoomPagesState, on: str) -> None:
    machine, pool = _machine_in(state)
    cell = PAGE_LEDGER_TABLE.cell(state, on)
    before, owners = machine.snapshot(), dict(pool.owner)
    if cell:
        _, fired = machine.fire(SAMPLES[on], 1.0)
        assert machine.state in {r.target for r in cell}
        assert fired.source == state.name and fired.on == on
        held = machine.pages if machine.state is not RoomPagesState.FREE else ()
        assert sorted(p for p, key in pool.owner.items() if key == (1, 1)) == sorted(held)
    else:
        with pytest.raises(ProtocolError) as refused:
            machine.fire(SAMPLES[on], 1.0)
        assert refused.value.machine == "PageLedger"
        assert machine.snapshot() == before and pool.owner == owners


# ---- scenarios ---------------------------------------------------------------------------------
def _freed(step: Step) -> list[PagesFreed]:
    return [o for o in step.outputs if isinstance(o, PagesFreed)]


def _fenced_ledger(writers: tuple[PeerId, ...] = (A,)) -> PageLedger:
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0, 1, 2)), 0.0)
    ledger.handle(Fence(7, 1, writers), 1.0)
    return ledger


def test_abort_mid_transfer_holds_pages_until_the_writer_drains() -> None:
    """sglang#35049 / #32564 / #24578: a decode abort freed pages while an RDMA write was still
    landing, so the next request read the wrong KV. Here the fenced pages cannot be reserved
    again, admission does not count them, and only the writer's drain ACK frees them."""
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0, 1, 2)), 0.0)
    step = ledger.handle(Fence(7, 1, (A, B)), 1.0)
    assert step.outputs == (PagesQuarantined(7, 1, (0, 1, 2), (A, B)),)
    assert ledger.allocatable == POOL - 3
    before = ledger.snapshot()
    with pytest.raises(InvalidInput, match="not free"):
        ledger.handle(Reserve(8, 1, (2, 3)), 2.0)
    assert ledger.snapshot() == before
    assert _freed(ledger.handle(AckArrived(7, 1, A), 3.0)) == []
    assert ledger.state_of(7, 1) is RoomPagesState.FENCED
    assert _freed(ledger.handle(AckArrived(7, 1, B), 4.0)) == [PagesFreed(7, 1, (0, 1, 2))]
    assert ledger.allocatable == POOL
    ledger.handle(Reserve(8, 1, (2, 3)), 5.0)
    assert ledger.state_of(8, 1) is RoomPagesState.RESERVED


def test_a_missing_ack_quarantines_forever_and_is_reported() -> None:
    """sglang#38961: when the drain ACK never came, the decode "released anyway" after 30 s,
    a use-after-free window. Here no amount of time frees the pages: they stay quarantined,
    the ledger asks for no timer, and the report shows them with their age."""
    ledger = _fenced_ledger((A,))
    for now in (31.0, 3600.0, 86_400.0):
        assert ledger.state_of(7, 1) is RoomPagesState.FENCED
        (held,) = ledger.report(now)
        assert (held.room, held.generation, held.pages, held.waiting_on) == (7, 1, (0, 1, 2), (A,))
        assert held.age_s == now - 1.0
        assert ledger.allocatable == POOL - 3
    assert ledger.snapshot().quarantined == 3


@pytest.mark.parametrize("order", ["dead_first", "closed_first"])
def test_dead_writer_clears_only_once_its_session_is_closed(order: str) -> None:
    ledger = _fenced_ledger((A,))
    news: list[WriterDead | SessionClosed] = [WriterDead(A), SessionClosed(A)]
    first, second = news if order == "dead_first" else news[::-1]
    assert _freed(ledger.handle(first, 2.0)) == []
    assert ledger.state_of(7, 1) is RoomPagesState.FENCED
    assert _freed(ledger.handle(second, 3.0)) == [PagesFreed(7, 1, (0, 1, 2))]
    assert ledger.report(4.0) == ()


def test_writer_already_gone_when_the_fence_is_armed_is_cleared_at_once() -> None:
    ledger = PageLedger(POOL)
    ledger.handle(WriterDead(A), 0.0)
    ledger.handle(SessionClosed(A), 0.0)
    ledger.handle(Reserve(7, 1, (0,)), 0.0)
    step = ledger.handle(Fence(7, 1, (A, B)), 1.0)
    assert step.outputs == (PagesQuarantined(7, 1, (0,), (B,)),)
    assert _freed(ledger.handle(AckArrived(7, 1, B), 2.0)) == [PagesFreed(7, 1, (0,))]


Path = Callable[[PageLedger], None]


def _success(ledger: PageLedger) -> None:
    ledger.handle(ReleaseAfterSuccess(7, 1), 1.0)


def _unpublished(ledger: PageLedger) -> None:
    ledger.handle(ReleaseUnpublished(7, 1), 1.0)


def _fence_without_writers(ledger: PageLedger) -> None:
    ledger.handle(Fence(7, 1, ()), 1.0)


def _fence_then_acks(ledger: PageLedger) -> None:
    ledger.handle(Fence(7, 1, (A, B)), 1.0)
    ledger.handle(AckArrived(7, 1, B), 2.0)
    ledger.handle(AckArrived(7, 1, A), 3.0)


def _fence_then_deaths(ledger: PageLedger) -> None:
    ledger.handle(Fence(7, 1, (A, B)), 1.0)
    ledger.handle(AckArrived(7, 1, A), 2.0)
    ledger.handle(SessionClosed(B), 3.0)
    ledger.handle(WriterDead(B), 4.0)


@pytest.mark.parametrize(
    "path",
    [_success, _unpublished, _fence_without_writers, _fence_then_acks, _fence_then_deaths],
    ids=lambda p: p.__name__.strip("_"),
)
def test_every_path_ends_free(path: Path) -> None:
    """sglang#9266 / #8177: pages leaked on abort until token usage crept to 1.0. Every way a
    room can end returns all its pages, and the ledger forgets the room."""
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (3, 4, 5)), 0.0)
    path(ledger)
    snap = ledger.snapshot()
    assert (snap.free, snap.reserved, snap.quarantined, snap.rooms) == (POOL, 0, 0, ())


def test_a_stale_generations_ack_never_frees_the_reused_room() -> None:
    ledger = _fenced_ledger((A,))
    ledger.handle(AckArrived(7, 1, A), 2.0)
    ledger.handle(Reserve(7, 2, (0, 1, 2)), 3.0)
    ledger.handle(Fence(7, 2, (A,)), 4.0)
    before = ledger.snapshot()
    step = ledger.handle(AckArrived(7, 1, A), 5.0)  # a duplicate of generation 1's ACK
    assert step.outputs == () and ledger.snapshot() == before
    assert step.fired[0].source == "FREE"
    assert ledger.state_of(7, 2) is RoomPagesState.FENCED


@pytest.mark.parametrize(
    "ack",
    [AckArrived(7, 1, B), AckArrived(9, 1, A), AckArrived(7, 3, A)],
    ids=["not_a_writer", "unknown_room", "unknown_generation"],
)
def test_foreign_and_duplicate_acks_change_nothing(ack: AckArrived) -> None:
    ledger = _fenced_ledger((A,))
    before = ledger.snapshot()
    assert ledger.handle(ack, 2.0).outputs == ()
    assert ledger.snapshot() == before


def test_duplicate_ack_after_a_partial_drain_changes_nothing() -> None:
    ledger = _fenced_ledger((A, B))
    ledger.handle(AckArrived(7, 1, A), 2.0)
    before = ledger.snapshot()
    assert ledger.handle(AckArrived(7, 1, A), 3.0).outputs == ()
    assert ledger.snapshot() == before


def test_ack_before_the_fence_is_ignored() -> None:
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0,)), 0.0)
    ledger.handle(AckArrived(7, 1, A), 1.0)
    ledger.handle(Fence(7, 1, (A,)), 2.0)
    assert ledger.state_of(7, 1) is RoomPagesState.FENCED


@pytest.mark.parametrize(
    ("pages", "message"),
    [((0, 0), "distinct"), ((POOL,), "outside"), ((-1,), "outside")],
)
def test_bad_reservations_are_refused_without_change(pages: tuple[int, ...], message: str) -> None:
    ledger = PageLedger(POOL)
    before = ledger.snapshot()
    with pytest.raises(InvalidInput, match=message):
        ledger.handle(Reserve(1, 1, pages), 0.0)
    assert ledger.snapshot() == before


def test_releasing_twice_or_fencing_a_fenced_room_is_a_caller_bug() -> None:
    ledger = _fenced_ledger((A,))
    before = ledger.snapshot()
    for bad in (ReleaseUnpublished(7, 1), ReleaseAfterSuccess(7, 1), Fence(7, 1, (A,))):
        with pytest.raises(LocalProtocolError):
            ledger.handle(bad, 2.0)
    assert ledger.snapshot() == before
    ledger.handle(AckArrived(7, 1, A), 3.0)
    with pytest.raises(LocalProtocolError):
        ledger.handle(ReleaseAfterSuccess(7, 1), 4.0)


def test_fence_writers_must_be_distinct() -> None:
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0,)), 0.0)
    before = ledger.snapshot()
    with pytest.raises(InvalidInput, match="distinct"):
        ledger.handle(Fence(7, 1, (A, A)), 1.0)
    assert ledger.snapshot() == before


@pytest.mark.invariant("refusal_changes_nothing")
def test_a_refused_fence_leaves_no_writer_owing_an_ack() -> None:
    """A fence the ledger refuses (the room holds nothing, is fenced already, or names a writer
    twice) must not record an owed drain ACK: a writer owing one is never readmitted."""
    ledger = PageLedger(POOL)
    with pytest.raises(LocalProtocolError):
        ledger.handle(Fence(7, 1, (A,)), 1.0)  # room 7 holds no pages
    ledger.handle(Reserve(8, 1, (0,)), 1.0)
    with pytest.raises(InvalidInput, match="distinct"):
        ledger.handle(Fence(8, 1, (A, A)), 1.0)
    ledger.handle(Reserve(9, 1, (1,)), 1.0)
    ledger.handle(Fence(9, 1, (B,)), 1.0)
    with pytest.raises(LocalProtocolError):
        ledger.handle(Fence(9, 1, (A,)), 2.0)  # fenced already, on B
    assert not ledger.owes_acks(A), "A was never sent an ABORT: it owes nothing"
    assert ledger.owes_acks(B)
    ledger.handle(ReleaseAfterSuccess(8, 1), 3.0)
    assert not ledger.owes_acks(A)


def test_report_lists_the_oldest_fence_first() -> None:
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(1, 1, (0,)), 0.0)
    ledger.handle(Reserve(2, 1, (1,)), 0.0)
    ledger.handle(Fence(2, 1, (A,)), 5.0)
    ledger.handle(Fence(1, 1, (B,)), 9.0)
    assert [(q.room, q.age_s) for q in ledger.report(10.0)] == [(2, 5.0), (1, 1.0)]
    assert ledger.handle(WriterDead(A), 11.0).timer_at is None


def test_negative_pool_is_refused() -> None:
    with pytest.raises(InvalidInput):
        PageLedger(-1)


def test_a_release_during_local_verification_waits_for_it() -> None:
    # Chaos finding 5: the decode's staged scatter writes the pages while it verifies them.
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0, 1, 2)), 0.0)
    ledger.handle(VerifyStarted(7, 1), 1.0)
    released = ledger.handle(ReleaseAfterSuccess(7, 1), 1.1)
    assert not _freed(released)
    assert ledger.state_of(7, 1) is RoomPagesState.RELEASING and ledger.allocatable == POOL - 3
    assert [f.pages for f in _freed(ledger.handle(VerifyDone(7, 1), 1.2))] == [(0, 1, 2)]
    assert ledger.allocatable == POOL


def test_a_finished_verification_leaves_a_plain_reservation() -> None:
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0, 1)), 0.0)
    ledger.handle(VerifyStarted(7, 1), 1.0)
    ledger.handle(VerifyDone(7, 1), 1.1)
    assert ledger.state_of(7, 1) is RoomPagesState.RESERVED
    assert [f.pages for f in _freed(ledger.handle(ReleaseAfterSuccess(7, 1), 1.2))] == [(0, 1)]


def test_retiring_a_session_frees_exactly_the_fenced_rooms_published_under_it() -> None:
    """Fence by engine rotation: the old engine's destruction clears every writer of the rooms
    published under its session, alive or dead, and nothing else."""
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0, 1)), 0.0)
    ledger.handle(Fence(7, 1, (A, B), "old:1"), 1.0)
    ledger.handle(Reserve(8, 1, (2, 3)), 0.0)
    ledger.handle(Fence(8, 1, (A,), "new:2"), 1.0)
    ledger.handle(Reserve(9, 1, (4,)), 0.0)  # live, not fenced: never touched
    ledger.handle(WriterDead(A), 2.0)
    assert ledger.dead_held_pages() == 2  # room 8 waits on dead A only; room 7 on B too
    assert ledger.sessions_held() == {"old:1", "new:2"}
    step = ledger.handle(SessionRetired("old:1"), 3.0)
    assert _freed(step) == [PagesFreed(7, 1, (0, 1))]
    # Every fenced room hears of it; room 8, published under the new session, stays held.
    assert [(f.key, f.on, f.target) for f in step.fired] == [
        (7, "SessionRetired", "FREE"), (8, "SessionRetired", "FENCED")]  # fmt: skip
    assert ledger.state_of(8, 1) is RoomPagesState.FENCED
    assert ledger.state_of(9, 1) is RoomPagesState.RESERVED
    assert ledger.snapshot().retired_sessions == ("old:1",)
    # A fence armed later for a room of a retired session frees at once: nothing can land.
    ledger.handle(Reserve(10, 1, (5,)), 4.0)
    assert _freed(ledger.handle(Fence(10, 1, (B,), "old:1"), 5.0)) == [PagesFreed(10, 1, (5,))]


# ---- readmission: a dead verdict is revisable for a live writer ---------------------------------
def test_owed_acks_are_tracked_per_writer_until_each_drain_ack() -> None:
    ledger = _fenced_ledger((A, B))
    ledger.handle(Reserve(8, 1, (5,)), 1.0)
    ledger.handle(Fence(8, 1, (A,)), 1.0)
    assert ledger.owes_acks(A) and ledger.owes_acks(B)
    ledger.handle(AckArrived(7, 1, A), 2.0)
    assert ledger.owes_acks(A), "room 8 still waits on A"
    ledger.handle(AckArrived(8, 1, A), 2.0)
    assert not ledger.owes_acks(A) and ledger.owes_acks(B)


def test_readmission_lifts_the_verdict_and_a_room_that_cleared_the_writer_keeps_it() -> None:
    ledger = _fenced_ledger((A, B))
    ledger.handle(WriterDead(A), 2.0)
    ledger.handle(SessionClosed(A), 2.0)
    assert ledger.report(2.0)[0].waiting_on == (B,)
    ledger.handle(AckArrived(7, 1, A), 3.0)  # the paused writer resumed and drained
    ledger.handle(WriterReadmitted(A), 3.0)
    assert not ledger.is_dead(A) and ledger.snapshot().closed_sessions == ()
    assert ledger.report(3.0)[0].waiting_on == (B,), "A stays cleared for room 7"
    # A new room fenced with A waits for A's ACK again: the old fence no longer speaks for it.
    ledger.handle(Reserve(9, 1, (6,)), 4.0)
    assert ledger.handle(Fence(9, 1, (A,)), 4.0).outputs == (PagesQuarantined(9, 1, (6,), (A,)),)


def test_a_fence_reported_after_readmission_changes_nothing() -> None:
    """The shell fenced A (a task) and reported it only after A was readmitted: taking that
    report would let A's next death free pages before that death's own fence."""
    ledger = _fenced_ledger((A,))
    ledger.handle(WriterDead(A), 1.0)
    ledger.handle(AckArrived(7, 1, A), 2.0)
    ledger.handle(WriterReadmitted(A), 2.0)
    before = ledger.snapshot()
    assert ledger.handle(SessionClosed(A), 3.0) == Step((), None, ())
    assert ledger.snapshot() == before
    ledger.handle(Reserve(9, 1, (6,)), 4.0)
    ledger.handle(Fence(9, 1, (A,)), 4.0)
    assert _freed(ledger.handle(WriterDead(A), 5.0)) == [], "dead again, but not fenced again"


def test_retiring_a_session_forgives_the_acks_owed_for_rooms_published_under_it() -> None:
    """A writer wrongly declared dead is readmitted only once it owes no drain ACK; after the
    engine of a session is destroyed nothing it wrote there can land, so those ACKs are moot
    (else readmission waits until its writes to the destroyed engine time out)."""
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0,)), 0.0)
    ledger.handle(Fence(7, 1, (A,), "old:1"), 1.0)
    ledger.handle(Reserve(8, 1, (1,)), 0.0)
    ledger.handle(Fence(8, 1, (B,), "new:2"), 1.0)
    assert ledger.owes_acks(A) and ledger.owes_acks(B)
    ledger.handle(SessionRetired("old:1"), 2.0)
    assert not ledger.owes_acks(A), "room 7's engine is gone"
    assert ledger.owes_acks(B), "room 8 was published under the live session"


def test_a_fence_after_its_session_retired_owes_no_ack() -> None:
    """The fence frees the pages at once (no writer can land through a destroyed engine), and
    owes no drain ACK, as when the retirement comes after the fence: the writer owed one for a
    room already free, and its readmission waited on that ACK."""
    ledger = PageLedger(POOL)
    ledger.handle(Reserve(7, 1, (0,)), 0.0)
    ledger.handle(SessionRetired("old:1"), 1.0)
    assert _freed(ledger.handle(Fence(7, 1, (A,), "old:1"), 2.0)) == [PagesFreed(7, 1, (0,))]
    assert not ledger.owes_acks(A)
    ledger.handle(Reserve(8, 1, (1,)), 3.0)
    ledger.handle(Fence(8, 1, (A,), ""), 4.0)
    assert ledger.owes_acks(A), "a fence without a session is never forgiven by a retirement"
