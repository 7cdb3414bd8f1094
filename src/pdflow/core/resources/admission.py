"""Decode admission: admit a request for transfer only if no admission can deadlock the pool.

A request waiting for or in transfer cannot be retracted, so its pages are fixed until it
finishes. Admission therefore keeps this promise: after admitting, the free pages plus the pages
that retracting every running request would free are at least the largest growth any single
in-flight request may still need. So whichever request the engine lets run, it can finish.

Per request, in whole pages (a partial prefix page counts as new: it must be copied):

* ``held``: the new prompt tokens plus the first ``reserve_tokens`` of decoding (never more than
  the request can generate), reserved at admission;
* ``worst``: the new prompt tokens plus ``min(max_new, clip_max_new)`` generated tokens;
* growth = ``worst - held``, pages it may still allocate after admission.

A request whose ``worst`` exceeds the whole pool can never run and is rejected at enqueue, which
is why an empty pool always admits the queue's head: FIFO admission never waits forever.
``clip_max_new`` bounds the estimate as SGLang does; requests that really generate past it rely
on the engine retracting running requests.

:class:`AdmissionQueue` is the table-driven FIFO queue over that rule; see
spec/machines/admission.toml.
"""

from __future__ import annotations

import enum
from collections import Counter

import msgspec

from pdflow.core.framework.errors import InvalidInput, LocalProtocolError
from pdflow.core.framework.step import Step
from pdflow.core.framework.table import Fired, Table, TableMachine, row
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.core.protocol.outputs import Output

NUM_RESERVED_DECODE_TOKENS = 512
CLIP_MAX_NEW_TOKENS = 4096


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class AdmissionBudget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pool_pages: int
    page_size: int
    reserve_tokens: int = NUM_RESERVED_DECODE_TOKENS
    clip_max_new: int = CLIP_MAX_NEW_TOKENS

    def __post_init__(self) -> None:
        for name in ("pool_pages", "page_size", "clip_max_new"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.reserve_tokens < 0:
            raise InvalidInput(f"reserve_tokens must be >= 0, got {self.reserve_tokens}")

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.page_size


class RequestDemand(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a request asks of the pool: its prompt, its generation limit, its cached prefix."""

    input_len: int
    max_new: int
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise InvalidInput(f"input_len must be >= 1, got {self.input_len}")
        if self.max_new < 0:
            raise InvalidInput(f"max_new must be >= 0, got {self.max_new}")
        if not 0 <= self.prefix_len <= self.input_len:
            raise InvalidInput(
                f"prefix_len must be in [0, input_len={self.input_len}], got {self.prefix_len}"
            )


class Footprint(msgspec.Struct, frozen=True):
    held_pages: int
    worst_pages: int

    @property
    def growth_pages(self) -> int:
        return self.worst_pages - self.held_pages


def footprint(budget: AdmissionBudget, demand: RequestDemand) -> Footprint:
    page = budget.page_size
    first_new_page = demand.prefix_len // page
    growth = min(demand.max_new, budget.clip_max_new)
    held_end = demand.input_len + min(growth, budget.reserve_tokens)
    worst_end = demand.input_len + growth
    return Footprint(
        held_pages=_ceil_div(held_end, page) - first_new_page,
        worst_pages=_ceil_div(worst_end, page) - first_new_page,
    )


class PoolView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The pool as the decision sees it."""

    free_pages: int
    inflight: tuple[RequestDemand, ...] = ()
    """Admitted requests waiting for or in transfer: they cannot be retracted."""
    retractable_pages: int = 0
    """Pages held by running requests, which the engine may retract to make room."""


class AdmissionDecision(msgspec.Struct, frozen=True, gc=False):
    """The verdict with every number it rests on, for logs and for the caller."""

    admit: bool
    reason: str
    fits_pool: bool
    """False when the request could not run even in an empty pool: waiting never helps."""
    held_pages: int
    worst_pages: int
    free_pages: int
    free_pages_after: int
    retractable_pages: int
    largest_growth_pages: int


def decide_admission(
    budget: AdmissionBudget, pool: PoolView, candidate: RequestDemand
) -> AdmissionDecision:
    """Whether ``candidate`` may be admitted now. Pure; raises only on an inconsistent view."""
    if pool.free_pages < 0 or pool.retractable_pages < 0:
        raise InvalidInput("free_pages and retractable_pages must be >= 0")
    inflight = [footprint(budget, demand) for demand in pool.inflight]
    accounted = pool.free_pages + pool.retractable_pages + sum(f.held_pages for f in inflight)
    if accounted > budget.pool_pages:
        raise InvalidInput(
            f"the pool view accounts for {accounted} pages but the pool has {budget.pool_pages}; "
            "free, retractable and in-flight pages must not overlap"
        )
    largest = max((f.growth_pages for f in inflight), default=0)
    return decide_on_totals(budget, pool.free_pages, pool.retractable_pages, largest, candidate)


def decide_on_totals(
    budget: AdmissionBudget,
    free_pages: int,
    retractable_pages: int,
    largest_inflight_growth: int,
    candidate: RequestDemand,
) -> AdmissionDecision:
    """:func:`decide_admission` on the pool's totals (what the queue keeps up to date, so a
    decision costs O(1) however many requests are in flight)."""
    own = footprint(budget, candidate)
    free_after = free_pages - own.held_pages
    largest_growth = max(largest_inflight_growth, own.growth_pages)
    headroom = free_after + retractable_pages
    fits_pool = own.worst_pages <= budget.pool_pages
    if not fits_pool:
        reason = (
            f"needs up to {own.worst_pages} pages but the whole pool has {budget.pool_pages}: "
            "it can never run here; reject it or lower max_new"
        )
    elif free_after < 0:
        reason = (
            f"needs {own.held_pages} pages now but only {free_pages} are free; wait for a "
            "request to finish"
        )
    elif headroom < largest_growth:
        reason = (
            f"admitting would leave {free_after} free + {retractable_pages} retractable "
            f"pages, fewer than the {largest_growth} pages one in-flight request may still "
            "grow by; wait for a request to finish"
        )
    else:
        reason = (
            f"reserves {own.held_pages} pages; {free_after} free + {retractable_pages} "
            f"retractable pages remain for the largest growth of {largest_growth}"
        )
    verdict = fits_pool and free_after >= 0 and headroom >= largest_growth
    return AdmissionDecision(
        admit=verdict,
        reason=reason,
        fits_pool=fits_pool,
        held_pages=own.held_pages,
        worst_pages=own.worst_pages,
        free_pages=free_pages,
        free_pages_after=free_after,
        retractable_pages=retractable_pages,
        largest_growth_pages=largest_growth,
    )


# ---- the queue machine ---------------------------------------------------------------------
class QueueState(enum.Enum):
    IDLE = "IDLE"
    """Nothing is queued (requests may still be admitted)."""
    QUEUED = "QUEUED"
    """Requests wait and the head may fit: the next AdmitRequests will try."""
    BLOCKED = "BLOCKED"
    """The head does not fit the pool as it is; only a finish or cancelling the head helps."""


class EnqueueRequest(Input, frozen=True, tag="EnqueueRequest"):
    request_id: str
    input_len: int
    max_new: int
    prefix_len: int = 0


class AdmitRequests(Input, frozen=True, tag="AdmitRequests"):
    """Admit queued requests from the head, in order, while they fit."""


class FinishRequest(Input, frozen=True, tag="FinishRequest"):
    """An admitted request is done (or its room is quiescent): its pages return to the pool."""

    request_id: str


class CancelRequest(Input, frozen=True, tag="CancelRequest"):
    """A queued request leaves the queue. Admitted requests cannot be cancelled here."""

    request_id: str


class RequestAdmitted(Output, frozen=True, tag="admitted"):
    request_id: str
    reserve_pages: int
    worst_pages: int


class AdmissionBlocked(Output, frozen=True, tag="admission_blocked"):
    request_id: str
    decision: AdmissionDecision


class RequestRejected(Output, frozen=True, tag="admission_rejected"):
    request_id: str
    reason: str


class RequestCancelled(Output, frozen=True, tag="admission_cancelled"):
    request_id: str


class RequestReleased(Output, frozen=True, tag="admission_released"):
    request_id: str
    pages: int


class QueueSnapshot(msgspec.Struct, frozen=True):
    state: str
    queued: tuple[str, ...]
    admitted: tuple[tuple[str, int], ...]
    free_pages: int


_Q = QueueState
_ADMITTED, _BLOCKED = "admitted", "admission_blocked"
_REJECTED, _CANCELLED, _RELEASED = "admission_rejected", "admission_cancelled", "admission_released"


class AdmissionQueue(TableMachine[QueueState]):
    """The decode's FIFO admission queue over one KV pool. Drive it with :meth:`handle`."""

    table: Table[QueueState]

    def __init__(self, budget: AdmissionBudget) -> None:
        self.key = 0
        self.budget = budget
        self.state = ADMISSION_TABLE.initial
        self.queue: dict[str, RequestDemand] = {}  # insertion order is FIFO order
        self.admitted: dict[str, RequestDemand] = {}
        # Running totals over ``admitted``, so no decision walks the requests in flight.
        self._reserved = 0
        self._growths: Counter[int] = Counter()  # growth pages -> admitted requests with it
        self._largest_growth = 0

    # ---- public API ----------------------------------------------------------------------------
    @property
    def reserved_pages(self) -> int:
        return self._reserved

    @property
    def largest_growth(self) -> int:
        """The largest growth any admitted request may still need (0 when none is admitted)."""
        return self._largest_growth

    @property
    def free_pages(self) -> int:
        return self.budget.pool_pages - self.reserved_pages

    def snapshot(self) -> QueueSnapshot:
        return QueueSnapshot(
            state=self.state.name,
            queued=tuple(self.queue),
            admitted=tuple(
                (rid, footprint(self.budget, d).held_pages) for rid, d in self.admitted.items()
            ),
            free_pages=self.free_pages,
        )

    def decide(self, demand: RequestDemand) -> AdmissionDecision:
        """The decision for ``demand`` against the pool as it is now (O(1))."""
        return decide_on_totals(self.budget, self.free_pages, 0, self._largest_growth, demand)

    def timer_at(self) -> float | None:
        return None  # no deadlines: waiting for memory is not a failure

    def handle(self, inp: Input, now: float) -> Step:
        outputs, fired = self.fire(inp, now)
        return Step(tuple(outputs), self.timer_at(), (fired,))

    def fire(self, inp: Input, now: float) -> tuple[list[Output], Fired]:
        if isinstance(inp, CancelRequest) and inp.request_id in self.admitted:
            # Checked before the table so the refusal says why in every state.
            raise LocalProtocolError(
                f"request {inp.request_id!r} is admitted and waiting for or in transfer, so it "
                "cannot be retracted",
                machine=self.table.machine,
                state=self.state.name,
                input_name="CancelRequest",
                hint="abort its room, and send FinishRequest once its pages are released",
            )
        return super().fire(inp, now)

    # ---- validation: raise before anything changes -------------------------------------------
    def _validate(self, inp: Input, now: float) -> None:
        if isinstance(inp, EnqueueRequest):
            if not inp.request_id:
                raise InvalidInput("request_id must be a non-empty string")
            if inp.request_id in self.queue or inp.request_id in self.admitted:
                raise InvalidInput(f"request {inp.request_id!r} is already queued or admitted")
            _demand_of(inp)
        elif isinstance(inp, FinishRequest) and inp.request_id not in self.admitted:
            if inp.request_id in self.queue:
                raise LocalProtocolError(
                    f"request {inp.request_id!r} is still queued, not admitted",
                    machine=self.table.machine,
                    state=self.state.name,
                    input_name="FinishRequest",
                    hint="use CancelRequest for a queued request",
                )
            raise InvalidInput(f"request {inp.request_id!r} is not admitted")
        elif isinstance(inp, CancelRequest) and inp.request_id not in self.queue:
            raise InvalidInput(f"request {inp.request_id!r} is not queued")

    # ---- guards ------------------------------------------------------------------------------
    def _guard_exceeds_pool(self, inp: EnqueueRequest, now: float) -> bool:
        return not self.decide(_demand_of(inp)).fits_pool

    def _guard_admits_whole_queue(self, inp: Input, now: float) -> bool:
        admissible, _ = self._head_of_line()
        return len(admissible) == len(self.queue)

    def _guard_empties_queue(self, inp: Input, now: float) -> bool:
        return len(self.queue) == 1

    def _guard_cancels_head(self, inp: CancelRequest, now: float) -> bool:
        return inp.request_id == next(iter(self.queue))

    # ---- actions -----------------------------------------------------------------------------
    def _act_reject(self, inp: EnqueueRequest, now: float) -> list[Output]:
        enqueue = inp
        decision = self.decide(_demand_of(enqueue))
        return [RequestRejected(enqueue.request_id, decision.reason)]

    def _act_enqueue(self, inp: EnqueueRequest, now: float) -> list[Output]:
        enqueue = inp
        self.queue[enqueue.request_id] = _demand_of(enqueue)
        return []

    def _act_admit_head_of_line(self, inp: Input, now: float) -> list[Output]:
        admissible, blocked = self._head_of_line()
        outputs: list[Output] = []
        for rid in admissible:
            demand = self.queue.pop(rid)
            self.admitted[rid] = demand
            size = footprint(self.budget, demand)
            self._count(size, +1)
            outputs.append(RequestAdmitted(rid, size.held_pages, size.worst_pages))
        if blocked is not None:
            outputs.append(AdmissionBlocked(next(iter(self.queue)), blocked))
        return outputs

    def _act_finish(self, inp: FinishRequest, now: float) -> list[Output]:
        rid = inp.request_id
        size = footprint(self.budget, self.admitted.pop(rid))
        self._count(size, -1)
        return [RequestReleased(rid, size.held_pages)]

    def _act_cancel(self, inp: CancelRequest, now: float) -> list[Output]:
        rid = inp.request_id
        del self.queue[rid]
        return [RequestCancelled(rid)]

    # ---- helpers -----------------------------------------------------------------------------
    def _count(self, size: Footprint, delta: int) -> None:
        """Add (+1) or remove (-1) one admitted request from the running totals."""
        self._reserved += delta * size.held_pages
        growth = size.growth_pages
        self._growths[growth] += delta
        if self._growths[growth] <= 0:
            del self._growths[growth]
        if delta > 0:
            self._largest_growth = max(self._largest_growth, growth)
        elif growth == self._largest_growth and growth not in self._growths:
            # Distinct growth values are few (bounded by clip_max_new / page size).
            self._largest_growth = max(self._growths, default=0)

    def _head_of_line(self) -> tuple[list[str], AdmissionDecision | None]:
        """The queued ids that would be admitted in order, and the head's refusal if any.
        Costs O(admitted + 1) decisions, each O(1)."""
        largest = self._largest_growth
        free = self.free_pages
        admissible: list[str] = []
        for rid, demand in self.queue.items():
            decision = decide_on_totals(self.budget, free, 0, largest, demand)
            if not decision.admit:
                return admissible, decision
            admissible.append(rid)
            largest = decision.largest_growth_pages
            free = decision.free_pages_after
        return admissible, None


_M = AdmissionQueue
ADMISSION_TABLE: Table[QueueState] = Table(
    machine="AdmissionQueue",
    states=QueueState,
    initial=QueueState.IDLE,
    inputs=(EnqueueRequest, AdmitRequests, FinishRequest, CancelRequest, Tick),
    remote_inputs=(),
    rows=[
        # -- IDLE: nothing queued ------------------------------------------------------------
        row(_Q.IDLE, EnqueueRequest, _Q.IDLE,
            guard=_M._guard_exceeds_pool, emits=[_REJECTED], action=_M._act_reject),
        row(_Q.IDLE, EnqueueRequest, _Q.QUEUED, action=_M._act_enqueue),
        row(_Q.IDLE, AdmitRequests, _Q.IDLE),
        row(_Q.IDLE, FinishRequest, _Q.IDLE, emits=[_RELEASED], action=_M._act_finish),
        row(_Q.IDLE, Tick, _Q.IDLE),
        # -- QUEUED: the head may fit --------------------------------------------------------
        row(_Q.QUEUED, EnqueueRequest, _Q.QUEUED,
            guard=_M._guard_exceeds_pool, emits=[_REJECTED], action=_M._act_reject),
        row(_Q.QUEUED, EnqueueRequest, _Q.QUEUED, action=_M._act_enqueue),
        row(_Q.QUEUED, AdmitRequests, _Q.IDLE,
            guard=_M._guard_admits_whole_queue, emits=[_ADMITTED],
            action=_M._act_admit_head_of_line),
        row(_Q.QUEUED, AdmitRequests, _Q.BLOCKED,
            emits=[_ADMITTED, _BLOCKED], action=_M._act_admit_head_of_line),
        row(_Q.QUEUED, FinishRequest, _Q.QUEUED, emits=[_RELEASED], action=_M._act_finish),
        row(_Q.QUEUED, CancelRequest, _Q.IDLE,
            guard=_M._guard_empties_queue, emits=[_CANCELLED], action=_M._act_cancel),
        row(_Q.QUEUED, CancelRequest, _Q.QUEUED, emits=[_CANCELLED], action=_M._act_cancel),
        row(_Q.QUEUED, Tick, _Q.QUEUED),
        # -- BLOCKED: the head waits for pages; the tail waits behind it (FIFO) --------------
        row(_Q.BLOCKED, EnqueueRequest, _Q.BLOCKED,
            guard=_M._guard_exceeds_pool, emits=[_REJECTED], action=_M._act_reject),
        row(_Q.BLOCKED, EnqueueRequest, _Q.BLOCKED, action=_M._act_enqueue),
        row(_Q.BLOCKED, AdmitRequests, _Q.BLOCKED),
        row(_Q.BLOCKED, FinishRequest, _Q.QUEUED, emits=[_RELEASED], action=_M._act_finish),
        row(_Q.BLOCKED, CancelRequest, _Q.IDLE,
            guard=_M._guard_empties_queue, emits=[_CANCELLED], action=_M._act_cancel),
        row(_Q.BLOCKED, CancelRequest, _Q.QUEUED,
            guard=_M._guard_cancels_head, emits=[_CANCELLED], action=_M._act_cancel),
        row(_Q.BLOCKED, CancelRequest, _Q.BLOCKED, emits=[_CANCELLED], action=_M._act_cancel),
        row(_Q.BLOCKED, Tick, _Q.BLOCKED),
    ],
    keyed_by_room=False,
)  # fmt: skip
AdmissionQueue.table = ADMISSION_TABLE


def _demand_of(enqueue: EnqueueRequest) -> RequestDemand:
    return RequestDemand(enqueue.input_len, enqueue.max_new, enqueue.prefix_len)
