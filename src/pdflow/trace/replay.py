"""Deterministic replay: rebuild each endpoint from its header, re-feed every recorded input at
its recorded time, and check the step against the record field by field.

The core is pure, so equal inputs give equal steps; any difference is a divergence (a changed
core, a changed spec, or a trace that was edited). Replay stops at the first divergence in the
merged order and keeps the endpoints as they were after the last step it checked, so a caller
(the simulator) can take their snapshots and re-check invariants.
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
    input_rooms,
    outputs_as_builtins,
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
    """The rooms the diverging input addresses, for a pointer to their timelines."""


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

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def snapshots(self) -> dict[str, msgspec.Struct]:
        """Each endpoint's ``snapshot()`` where replay stopped (the final state when ok)."""
        return {name: endpoint.snapshot() for name, endpoint in self.endpoints.items()}


StepHook = Callable[[StepRecord, dict[str, TracedEndpoint]], None]


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


def replay(trace: Trace, *, force: bool = False, on_step: StepHook | None = None) -> ReplayResult:
    """Replay every record; ``on_step(record, endpoints)`` runs after each matching step."""
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
    with paused_gc():
        checked, counts, divergence = _run(trace.records, endpoints, on_step)
    elapsed = time.perf_counter() - started
    return ReplayResult(checked, endpoints, elapsed, divergence, bool(mismatches), counts)


def _run(
    records: list[StepRecord], endpoints: dict[str, TracedEndpoint], on_step: StepHook | None
) -> tuple[int, dict[str, int], Divergence | None]:
    counts = dict.fromkeys(endpoints, 0)
    checked = 0
    divergence: Divergence | None = None
    last_t: dict[str, float] = {}
    for record in records:
        endpoint = endpoints[record.endpoint]
        before = last_t.get(record.endpoint, record.t)
        last_t[record.endpoint] = record.t
        if record.t < before:
            # No pdflow clock goes back: the records were reordered, spliced or edited, even
            # where the steps happen to give the same outputs in the other order.
            diffs: tuple[FieldDiff, ...] = (FieldDiff(CLOCK_WENT_BACK, before, record.t),)
        else:
            diffs = _diffs(record, _observe(endpoint, record.input, record.t))
        if diffs:
            divergence = Divergence(
                record.endpoint, record.seq, record.t, msgspec.to_builtins(record.input), diffs,
                tuple(sorted(input_rooms(record.input))),
            )  # fmt: skip
            break
        checked += 1
        counts[record.endpoint] += 1
        if on_step is not None:
            on_step(record, endpoints)
    return checked, counts, divergence


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
