"""Deterministic replay: rebuild each endpoint from its header, re-feed every recorded input at
its recorded time, and check the step against the record field by field.

The core is pure, so equal inputs give equal steps; any difference is a divergence (a changed
core, a changed spec, or a trace that was edited). Replay stops at the first divergence in the
merged order, or after the record asked for (``until``), and keeps the endpoints as they were
after the last step it checked, so a caller (the simulator, ``pdflow replay --room``) can read
their state there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import AnyEndpointInput, DecodeEndpointConfig
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.spec import spec_sha256
from pdflow.trace.format import StepError, StepRecord, TraceHeader
from pdflow.trace.merge import Trace, paused_gc
from pdflow.trace.observe import (
    TracedEndpoint,
    outputs_as_builtins,
    record_rooms,
    room_summaries,
    touched_rooms,
)

COMPARED_FIELDS = ("error", "outputs", "fired", "rooms", "timer_at")


class ReplayRefused(ValueError):
    """The trace cannot be replayed as given (another spec, records missing); says what to do."""


class FieldDiff(msgspec.Struct, frozen=True):
    field: str
    expected: Any
    got: Any


class Divergence(msgspec.Struct, frozen=True):
    endpoint: str
    seq: int
    t: float
    input: Any
    diffs: tuple[FieldDiff, ...]
    rooms: tuple[int, ...] = ()
    """The rooms the diverging record concerns (its input's, its transitions', its outputs'),
    for a pointer to their timelines."""


CLOCK_WENT_BACK = "t"
"""The diff field of a record whose t is below the previous record's of its endpoint: its
``expected`` is that earlier t, its ``got`` the record's own."""


@dataclass
class ReplayResult:
    records: int
    endpoints: dict[str, TracedEndpoint]
    elapsed_s: float
    divergence: Divergence | None = None
    skipped_spec_check: bool = False
    """The trace was recorded against another spec and replayed anyway (``force``)."""
    per_endpoint: dict[str, int] = field(default_factory=dict)
    last: StepRecord | None = None
    """The last record replayed and matched: where the endpoints' state stands."""
    stopped: bool = False
    """Replay stopped after the ``until`` record, as asked, before the end of the trace."""

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def snapshots(self) -> dict[str, msgspec.Struct]:
        """Each endpoint's ``snapshot()`` where replay stopped (the final state when ok)."""
        return {name: endpoint.snapshot() for name, endpoint in self.endpoints.items()}


StepHook = Callable[[StepRecord, dict[str, TracedEndpoint]], None]
BeforeStepHook = Callable[[StepRecord, TracedEndpoint], None]
StopPoint = tuple[str, int]
"""(endpoint, seq): the record after which replay stops."""


def build_endpoint(header: TraceHeader) -> TracedEndpoint:
    config = header.config
    if isinstance(config, DecodeEndpointConfig):
        return DecodeEndpoint(config)
    return PrefillEndpoint(config)


def spec_mismatches(trace: Trace, sha: str | None = None) -> list[str]:
    current = sha or spec_sha256()
    return [
        f"{name}: recorded against spec {h.spec_version} sha256 {h.spec_sha256[:12]}..., "
        f"this pdflow has sha256 {current[:12]}..."
        for name, h in trace.headers.items()
        if h.spec_sha256 != current
    ]


def replay(
    trace: Trace,
    *,
    force: bool = False,
    on_step: StepHook | None = None,
    before_step: BeforeStepHook | None = None,
    until: StopPoint | None = None,
) -> ReplayResult:
    """Replay every record, or up to and including ``until``; ``before_step(record, endpoint)``
    runs before each step is replayed (the divergent one too), ``on_step(record, endpoints)``
    after each matching step."""
    mismatches = spec_mismatches(trace)
    if mismatches and not force:
        raise ReplayRefused(
            "the trace was recorded against a different protocol spec:\n  "
            + "\n  ".join(mismatches)
            + "\nreplay it with the pdflow that recorded it, or pass --force to replay anyway"
        )
    if trace.gaps:
        name, (missing, found) = next(iter(trace.gaps.items()))
        raise ReplayRefused(
            f"endpoint {name}: records from seq {missing} are missing (next present: {found}); "
            "replay needs every record from seq 0. Give all rotated files (trace.jsonl.N ... "
            "trace.jsonl), or raise the trace's max bytes or backups so nothing is rotated away"
        )
    endpoints = {name: build_endpoint(header) for name, header in trace.headers.items()}
    started = time.perf_counter()
    result = ReplayResult(records=0, endpoints=endpoints, elapsed_s=0.0,
                          skipped_spec_check=bool(mismatches),
                          per_endpoint=dict.fromkeys(endpoints, 0))  # fmt: skip
    with paused_gc():
        _run(trace.records, result, on_step, before_step, until)
    result.elapsed_s = time.perf_counter() - started
    return result


def _run(
    records: list[StepRecord],
    result: ReplayResult,
    on_step: StepHook | None,
    before_step: BeforeStepHook | None,
    until: StopPoint | None,
) -> None:
    endpoints, counts = result.endpoints, result.per_endpoint
    checked = 0
    last: StepRecord | None = None
    last_t: dict[str, float] = {}
    for record in records:
        endpoint = endpoints[record.endpoint]
        if before_step is not None:
            before_step(record, endpoint)
        before = last_t.get(record.endpoint, record.t)
        last_t[record.endpoint] = record.t
        if record.t < before:
            # No pdflow clock goes back: the records were reordered, spliced or edited, even
            # where the steps happen to give the same outputs in the other order.
            diffs: tuple[FieldDiff, ...] = (FieldDiff(CLOCK_WENT_BACK, before, record.t),)
        else:
            diffs = _diffs(record, _observe(endpoint, record.input, record.t))
        if diffs:
            result.divergence = Divergence(
                record.endpoint, record.seq, record.t, msgspec.to_builtins(record.input), diffs,
                tuple(sorted(record_rooms(record))),
            )  # fmt: skip
            break
        checked += 1
        counts[record.endpoint] += 1
        last = record
        if on_step is not None:
            on_step(record, endpoints)
        if until is not None and record.seq == until[1] and record.endpoint == until[0]:
            result.stopped = record is not records[-1]
            break
    result.records, result.last = checked, last


def _observe(endpoint: TracedEndpoint, inp: AnyEndpointInput, now: float) -> dict[str, Any]:
    """What the recorder would have written for this step, in builtin form."""
    try:
        step = endpoint.handle(inp, now)
    except Exception as exc:
        return {
            "error": StepError(type(exc).__name__, str(exc)),
            "outputs": [],
            "fired": [],
            "rooms": room_summaries(endpoint, touched_rooms(inp, None)),
            "timer_at": endpoint.timer_at(),
        }
    return {
        "error": None,
        "outputs": outputs_as_builtins(step.outputs),
        "fired": step.fired,
        "rooms": room_summaries(endpoint, touched_rooms(inp, step)),
        "timer_at": step.timer_at,
    }


_CANONICAL = msgspec.json.Encoder(order="deterministic")


def _diffs(record: StepRecord, got: dict[str, Any]) -> tuple[FieldDiff, ...]:
    """Compare in the recorded JSON form (tuples and lists alike, keys sorted)."""
    expected = {
        "error": record.error,
        "outputs": record.outputs,
        "fired": record.fired,
        "rooms": record.rooms,
        "timer_at": record.timer_at,
    }
    if _CANONICAL.encode(expected) == _CANONICAL.encode(got):
        return ()  # the common case: one comparison per step
    diffs = []
    for name in COMPARED_FIELDS:
        want, have = _CANONICAL.encode(expected[name]), _CANONICAL.encode(got[name])
        if want != have:
            diffs.append(FieldDiff(name, msgspec.json.decode(want), msgspec.json.decode(have)))
    return tuple(diffs)
