"""Decode admission scenarios named after the peer bugs they answer."""

from __future__ import annotations

import pytest

from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.resources.admission import (
    AdmissionBlocked,
    AdmissionBudget,
    AdmissionQueue,
    AdmitRequests,
    CancelRequest,
    EnqueueRequest,
    FinishRequest,
    RequestAdmitted,
    RequestRejected,
)


def admitted(queue: AdmissionQueue) -> list[str]:
    step = queue.handle(AdmitRequests(), 0.0)
    return [o.request_id for o in step.outputs if isinstance(o, RequestAdmitted)]


def test_in_transfer_requests_cannot_be_retracted_so_admission_keeps_their_growth() -> None:
    """sglang#30033 / #6857: requests waiting for or in transfer cannot be retracted, so an
    admission that spends the pages they still need to grow wedges the decode for good. Here a
    request that would eat that headroom is held back (not admitted and stuck), and admitted
    as soon as the running ones finish: no deadlock, and every admitted request can finish."""
    budget = AdmissionBudget(pool_pages=48, page_size=16, reserve_tokens=32, clip_max_new=256)
    queue = AdmissionQueue(budget)
    queue.handle(EnqueueRequest("a", input_len=256, max_new=256), 0.0)
    queue.handle(EnqueueRequest("b", input_len=256, max_new=256), 0.0)
    step = queue.handle(AdmitRequests(), 0.0)
    assert [o.request_id for o in step.outputs if isinstance(o, RequestAdmitted)] == ["a"]
    [blocked] = [o for o in step.outputs if isinstance(o, AdmissionBlocked)]
    assert blocked.request_id == "b" and "may still grow" in blocked.decision.reason
    with pytest.raises(LocalProtocolError, match="cannot be retracted"):
        queue.handle(CancelRequest("a"), 0.0)
    queue.handle(FinishRequest("a"), 1.0)
    assert admitted(queue) == ["b"]
    assert queue.reserved_pages <= budget.pool_pages


def test_a_request_larger_than_the_whole_pool_is_refused_at_once() -> None:
    """sglang#6857: a request that can never fit must fail clearly, not sit at the head of the
    queue blocking everyone behind it."""
    queue = AdmissionQueue(AdmissionBudget(pool_pages=8, page_size=16))
    step = queue.handle(EnqueueRequest("huge", input_len=10_000, max_new=16), 0.0)
    [rejected] = [o for o in step.outputs if isinstance(o, RequestRejected)]
    assert rejected.request_id == "huge"
    queue.handle(EnqueueRequest("small", input_len=16, max_new=16), 0.0)
    assert admitted(queue) == ["small"]
