"""Random request streams: admission never overcommits the pool and never deadlocks.

Safety, after every step: the pages held by admitted requests fit the pool, and each admitted
request could grow to its worst case while the others keep theirs. Liveness: once the random
stream ends, finishing every admitted request (in a random order) and admitting again drains
the queue; in particular an empty pool always admits the head.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.resources.admission import (
    AdmissionBudget,
    AdmissionQueue,
    AdmitRequests,
    CancelRequest,
    EnqueueRequest,
    FinishRequest,
    QueueState,
    RequestAdmitted,
    RequestDemand,
    RequestRejected,
    footprint,
)

EXAMPLES = settings(max_examples=int(os.environ.get("PDFLOW_EXAMPLES", "200")), deadline=None)
NOW = 0.0

budgets = st.builds(
    AdmissionBudget,
    pool_pages=st.integers(1, 48),
    page_size=st.integers(1, 4),
    reserve_tokens=st.integers(0, 8),
    clip_max_new=st.integers(1, 40),
)


@st.composite
def enqueues(draw: st.DrawFn) -> tuple[str, int, int, int]:
    input_len = draw(st.integers(1, 80))
    return ("enqueue", input_len, draw(st.integers(0, 60)), draw(st.integers(0, input_len)))


operations = st.lists(
    st.one_of(
        enqueues(),
        st.just(("admit",)),
        st.tuples(st.just("finish"), st.integers(0, 100)),
        st.tuples(st.just("cancel"), st.integers(0, 100)),
    ),
    max_size=40,
)


def check_safety(queue: AdmissionQueue) -> None:
    sizes = [footprint(queue.budget, d) for d in queue.admitted.values()]
    held = sum(s.held_pages for s in sizes)
    assert held <= queue.budget.pool_pages
    for size in sizes:
        assert held + size.growth_pages <= queue.budget.pool_pages, "a request could not finish"
    assert (queue.state is QueueState.IDLE) == (not queue.queue)
    if queue.state is QueueState.BLOCKED:
        assert not queue.decide(next(iter(queue.queue.values()))).admit


def admit_checked(queue: AdmissionQueue) -> None:
    """AdmitRequests, checking that an empty pool admits the head whenever one is queued."""
    pool_was_empty, head_waiting = not queue.admitted, bool(queue.queue)
    outputs = queue.handle(AdmitRequests(), NOW).outputs
    admitted = [o for o in outputs if isinstance(o, RequestAdmitted)]
    if pool_was_empty and head_waiting:
        assert admitted, "an empty pool must admit the head"


def apply(queue: AdmissionQueue, op: tuple[Any, ...], serial: int) -> None:
    kind = op[0]
    if kind == "enqueue":
        _, input_len, max_new, prefix_len = op
        step = queue.handle(EnqueueRequest(f"r{serial}", input_len, max_new, prefix_len), NOW)
        rejected = any(isinstance(o, RequestRejected) for o in step.outputs)
        worst = footprint(queue.budget, RequestDemand(input_len, max_new, prefix_len))
        assert rejected == (worst.worst_pages > queue.budget.pool_pages)
        assert rejected != (f"r{serial}" in queue.queue), "rejected requests are never queued"
    elif kind == "admit":
        admit_checked(queue)
    elif kind == "finish" and queue.admitted:
        victim = list(queue.admitted)[op[1] % len(queue.admitted)]
        queue.handle(FinishRequest(victim), NOW)
    elif kind == "cancel" and queue.queue:
        victim = list(queue.queue)[op[1] % len(queue.queue)]
        queue.handle(CancelRequest(victim), NOW)


@EXAMPLES
@given(budget=budgets, ops=operations, data=st.data())
def test_admission_is_safe_and_never_deadlocks(
    budget: AdmissionBudget, ops: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    queue = AdmissionQueue(budget)
    for serial, op in enumerate(ops):
        apply(queue, op, serial)
        check_safety(queue)
    # Drain: every admitted request finishes, in a random order, so the head must get in.
    rounds = 0
    while queue.queue:
        rounds += 1
        assert rounds <= len(ops) + 1, "the queue stopped making progress"
        admit_checked(queue)
        check_safety(queue)
        for rid in data.draw(st.permutations(list(queue.admitted))):
            queue.handle(FinishRequest(rid), NOW)
            check_safety(queue)
    assert queue.state is QueueState.IDLE


@EXAMPLES
@given(budget=budgets, ops=operations)
def test_admitted_requests_cannot_be_cancelled(
    budget: AdmissionBudget, ops: list[tuple[Any, ...]]
) -> None:
    queue = AdmissionQueue(budget)
    for serial, op in enumerate(ops):
        apply(queue, op, serial)
    for rid in list(queue.admitted):
        before = queue.snapshot()
        try:
            queue.handle(CancelRequest(rid), NOW)
        except LocalProtocolError:
            assert queue.snapshot() == before
        else:
            raise AssertionError(f"cancelling admitted request {rid} was accepted")
