"""Admission: the decision's numbers, every state x input cell, and scripted scenarios."""

from __future__ import annotations

import pytest

from pdflow.core.framework.errors import InvalidInput, LocalProtocolError, ProtocolError
from pdflow.core.framework.table import Fired
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.core.resources.admission import (
    ADMISSION_TABLE,
    AdmissionBlocked,
    AdmissionBudget,
    AdmissionQueue,
    AdmitRequests,
    CancelRequest,
    EnqueueRequest,
    FinishRequest,
    PoolView,
    QueueState,
    RequestAdmitted,
    RequestCancelled,
    RequestDemand,
    RequestRejected,
    RequestReleased,
    decide_admission,
    footprint,
)

# One-token pages keep the arithmetic readable; page rounding has its own tests.
BUDGET = AdmissionBudget(pool_pages=20, page_size=1, reserve_tokens=2, clip_max_new=100)
NOW = 0.0


def enqueue(rid: str, input_len: int, max_new: int, prefix_len: int = 0) -> EnqueueRequest:
    return EnqueueRequest(rid, input_len, max_new, prefix_len)


# ---- footprint and the pure decision --------------------------------------------------------
def test_footprint_rounds_to_whole_pages_and_counts_a_partial_prefix_page() -> None:
    budget = AdmissionBudget(pool_pages=100, page_size=4, reserve_tokens=3, clip_max_new=10)
    # Tokens [4, 10 + 3) are new: pages 1..3 held; worst reaches token 20 -> pages 1..4.
    assert footprint(budget, RequestDemand(10, 10, prefix_len=6)) == footprint(
        budget, RequestDemand(10, 10, prefix_len=4)
    )
    size = footprint(budget, RequestDemand(10, 10, prefix_len=6))
    assert (size.held_pages, size.worst_pages, size.growth_pages) == (3, 4, 1)


def test_footprint_clips_max_new_and_never_reserves_past_it() -> None:
    budget = AdmissionBudget(pool_pages=100, page_size=1, reserve_tokens=512, clip_max_new=8)
    assert footprint(budget, RequestDemand(5, 1000)).worst_pages == 5 + 8
    tiny = footprint(budget, RequestDemand(5, 1))
    assert (tiny.held_pages, tiny.worst_pages) == (6, 6)


def test_defaults_follow_sglang() -> None:
    budget = AdmissionBudget(pool_pages=1, page_size=1)
    assert (budget.reserve_tokens, budget.clip_max_new) == (512, 4096)


def test_admits_when_the_largest_growth_still_fits() -> None:
    inflight = RequestDemand(5, 5)  # held 7, worst 10, growth 3
    decision = decide_admission(
        BUDGET, PoolView(free_pages=13, inflight=(inflight,)), RequestDemand(4, 6)
    )  # held 6, growth 4
    assert decision.admit and decision.fits_pool
    assert (decision.held_pages, decision.worst_pages) == (6, 10)
    assert (decision.free_pages_after, decision.largest_growth_pages) == (7, 4)


def test_refuses_when_admitting_would_strand_the_largest_growth() -> None:
    decision = decide_admission(
        BUDGET, PoolView(free_pages=13, inflight=(RequestDemand(5, 5),)), RequestDemand(10, 2)
    )
    assert not decision.admit and decision.fits_pool
    assert (decision.free_pages_after, decision.largest_growth_pages) == (1, 3)
    assert "grow" in decision.reason and "wait" in decision.reason


def test_retractable_pages_count_towards_growth_but_not_towards_the_reservation() -> None:
    running = (RequestDemand(2, 5),)  # held 4, growth 3
    candidate = RequestDemand(8, 2)  # held 10, growth 0
    tight = PoolView(free_pages=11, inflight=running)
    assert not decide_admission(BUDGET, tight, candidate).admit
    retractable = PoolView(free_pages=11, inflight=running, retractable_pages=2)
    assert decide_admission(BUDGET, retractable, candidate).admit
    # Pages a retraction could free are not free now: the candidate's own pages must be.
    short = PoolView(free_pages=9, inflight=running, retractable_pages=7)
    refused = decide_admission(BUDGET, short, candidate)
    assert not refused.admit and "only 9 are free" in refused.reason


def test_a_request_larger_than_the_pool_never_fits() -> None:
    decision = decide_admission(BUDGET, PoolView(free_pages=20), RequestDemand(15, 6))
    assert not decision.admit and not decision.fits_pool
    assert "never" in decision.reason and "21" in decision.reason


def test_inconsistent_views_and_demands_are_refused() -> None:
    with pytest.raises(InvalidInput, match="accounts for 27 pages"):
        decide_admission(
            BUDGET, PoolView(free_pages=20, inflight=(RequestDemand(5, 5),)), RequestDemand(1, 1)
        )
    with pytest.raises(InvalidInput, match="prefix_len"):
        RequestDemand(4, 1, prefix_len=5)
    with pytest.raises(InvalidInput, match="input_len"):
        RequestDemand(0, 1)
    with pytest.raises(InvalidInput, match="page_size"):
        AdmissionBudget(pool_pages=4, page_size=0)


# ---- the machine: every state x input cell --------------------------------------------------
def queue_in(state: QueueState) -> AdmissionQueue:
    """A queue with request "a" admitted (held 7, growth 3, 13 pages free) and in ``state``."""
    queue = AdmissionQueue(BUDGET)
    queue.handle(enqueue("a", 5, 5), NOW)
    queue.handle(AdmitRequests(), NOW)
    if state is QueueState.QUEUED:
        queue.handle(enqueue("q", 2, 0), NOW)
    elif state is QueueState.BLOCKED:
        queue.handle(enqueue("q", 10, 2), NOW)
        queue.handle(AdmitRequests(), NOW)
    assert queue.state is state
    return queue


def probes(queue: AdmissionQueue) -> dict[str, Input]:
    queued = next(iter(queue.queue), "a")
    return {
        "EnqueueRequest": enqueue("new", 1, 1),
        "AdmitRequests": AdmitRequests(),
        "FinishRequest": FinishRequest("a"),
        "CancelRequest": CancelRequest(queued),
        "Tick": Tick(),
    }


CELLS = [(state, on) for state in QueueState for on in ADMISSION_TABLE.inputs]


@pytest.mark.parametrize(("state", "on"), CELLS, ids=[f"{s.name}-{on}" for s, on in CELLS])
def test_every_cell(state: QueueState, on: str) -> None:
    queue = queue_in(state)
    probe = probes(queue)[on]
    cell = ADMISSION_TABLE.cell(state, on)
    if cell:
        queue.handle(probe, NOW)
        assert queue.state in {r.target for r in cell}
    else:
        before = queue.snapshot()
        with pytest.raises(LocalProtocolError) as info:
            queue.handle(probe, NOW)
        assert state.name in str(info.value) and on in str(info.value)
        assert queue.snapshot() == before, "a refused input must change nothing"


def test_every_input_is_probed() -> None:
    assert set(probes(queue_in(QueueState.IDLE))) == set(ADMISSION_TABLE.inputs)


# ---- scenarios --------------------------------------------------------------------------------
def test_every_transition_is_reachable_by_a_script() -> None:
    queue = AdmissionQueue(BUDGET)
    fired: set[Fired] = set()

    def do(inp: Input) -> None:
        fired.update(queue.handle(inp, NOW).fired)

    script: list[Input] = [
        Tick(), AdmitRequests(), enqueue("huge", 30, 0),             # IDLE rows
        enqueue("a", 5, 5), enqueue("huge2", 30, 0), Tick(),         # -> QUEUED
        AdmitRequests(),                                             # admits all -> IDLE
        enqueue("b", 10, 2), enqueue("c", 1, 0), AdmitRequests(),    # b blocks -> BLOCKED
        Tick(), AdmitRequests(), enqueue("huge3", 30, 0), enqueue("d", 1, 0),
        CancelRequest("c"),                                          # not the head: BLOCKED
        CancelRequest("b"),                                          # head -> QUEUED
        enqueue("e", 1, 0), CancelRequest("e"),                      # QUEUED stays
        enqueue("f", 10, 2), AdmitRequests(),                        # d admitted, f blocks
        FinishRequest("d"),                                          # BLOCKED -> QUEUED
        AdmitRequests(), CancelRequest("f"),                         # BLOCKED -> IDLE
        enqueue("g", 10, 2), FinishRequest("a"),                     # QUEUED finish
        AdmitRequests(), enqueue("h", 1, 0), CancelRequest("h"),     # QUEUED empties
        FinishRequest("g"),                                          # IDLE finish
        enqueue("i", 20, 0), enqueue("j", 1, 0), AdmitRequests(),    # i fills the pool
        CancelRequest("j"),                                          # BLOCKED empties
    ]  # fmt: skip
    for inp in script:
        do(inp)
    taken = {(f.source, f.on, f.guard, f.target) for f in fired}
    assert taken == ADMISSION_TABLE.transitions()


def test_oversized_request_is_rejected_at_enqueue_and_never_queued() -> None:
    queue = AdmissionQueue(BUDGET)
    step = queue.handle(enqueue("big", 15, 6), NOW)
    assert queue.state is QueueState.IDLE and queue.snapshot().queued == ()
    (rejected,) = step.outputs
    assert isinstance(rejected, RequestRejected) and "never" in rejected.reason


def test_head_of_line_blocks_the_tail_until_a_finish() -> None:
    queue = queue_in(QueueState.BLOCKED)  # a admitted; q (held 12) blocked
    queue.handle(enqueue("small", 1, 0), NOW)
    assert queue.handle(AdmitRequests(), NOW).outputs == ()
    assert queue.snapshot().queued == ("q", "small"), "FIFO: the tail never jumps the head"
    released = queue.handle(FinishRequest("a"), NOW).outputs
    assert released == (RequestReleased("a", 7),) and queue.state is QueueState.QUEUED
    step = queue.handle(AdmitRequests(), NOW)
    assert [o.request_id for o in step.outputs if isinstance(o, RequestAdmitted)] == [
        "q",
        "small",
    ]
    assert queue.snapshot().state == "IDLE" and queue.free_pages == 20 - 12 - 1


def test_blocked_output_explains_the_numbers() -> None:
    queue = queue_in(QueueState.IDLE)
    queue.handle(enqueue("q", 10, 2), NOW)
    (blocked,) = queue.handle(AdmitRequests(), NOW).outputs
    assert isinstance(blocked, AdmissionBlocked) and blocked.request_id == "q"
    assert blocked.decision.free_pages_after == 1 and blocked.decision.largest_growth_pages == 3


def test_admitted_request_cannot_be_cancelled_in_any_state() -> None:
    for state in QueueState:
        queue = queue_in(state)
        before = queue.snapshot()
        with pytest.raises(LocalProtocolError, match="cannot be retracted") as info:
            queue.handle(CancelRequest("a"), NOW)
        assert "abort its room" in str(info.value)
        assert queue.snapshot() == before


def test_cancel_returns_a_queued_request() -> None:
    queue = queue_in(QueueState.QUEUED)
    assert queue.handle(CancelRequest("q"), NOW).outputs == (RequestCancelled("q"),)
    assert queue.state is QueueState.IDLE


@pytest.mark.parametrize(
    ("inp", "error", "match"),
    [
        (enqueue("a", 1, 1), InvalidInput, "already queued or admitted"),
        (enqueue("q", 1, 1), InvalidInput, "already queued or admitted"),
        (enqueue("", 1, 1), InvalidInput, "non-empty"),
        (enqueue("x", 3, 1, prefix_len=4), InvalidInput, "prefix_len"),
        (enqueue("x", 3, -1), InvalidInput, "max_new"),
        (FinishRequest("q"), LocalProtocolError, "still queued"),
        (FinishRequest("nobody"), InvalidInput, "not admitted"),
        (CancelRequest("nobody"), InvalidInput, "not queued"),
    ],
)
def test_bad_inputs_are_refused_without_change(
    inp: Input, error: type[Exception], match: str
) -> None:
    queue = queue_in(QueueState.QUEUED)
    before = queue.snapshot()
    with pytest.raises(error, match=match):
        queue.handle(inp, NOW)
    assert queue.snapshot() == before


def test_refusals_are_typed_protocol_errors() -> None:
    queue = AdmissionQueue(BUDGET)
    with pytest.raises(ProtocolError, match="IDLE"):
        queue.handle(CancelRequest("nobody"), NOW)
    assert queue.timer_at() is None
