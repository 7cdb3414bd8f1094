"""Follow rooms or endpoints through a replay (`pdflow replay --room/--endpoint/--until`).

Each followed step is seen as replay runs it: its input, the transitions it fired, its outputs,
and each followed room's summary on that endpoint before and after the step, read from the
replayed endpoint (a matched step equals its record). Where replay stops (at ``--until``, at a
divergence, or at the end), :func:`state_at_stop` reads the replayed core state of the followed
rooms and endpoints through the endpoints' read-only queries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.room_host import RoomHost
from pdflow.trace.format import StepRecord
from pdflow.trace.merge import Trace
from pdflow.trace.observe import TracedEndpoint, record_rooms, room_fired
from pdflow.trace.replay import ReplayResult, StopPoint, build_endpoint, replay


class FollowError(ValueError):
    """A --room, --endpoint or --until that this trace cannot honour; says what it holds."""


class Follow(msgspec.Struct, frozen=True):
    """Which steps to show: those of ``endpoints`` (all when empty) that concern one of
    ``rooms`` (any when empty); with neither, none unless ``every_step``."""

    rooms: frozenset[int] = frozenset()
    endpoints: frozenset[str] = frozenset()
    every_step: bool = False

    @property
    def shows_steps(self) -> bool:
        return bool(self.rooms or self.endpoints or self.every_step)

    def rooms_shown(self, record: StepRecord) -> set[int] | None:
        """The rooms of the record to show (maybe none), or None: the record is not followed."""
        if not self.shows_steps or (self.endpoints and record.endpoint not in self.endpoints):
            return None
        rooms = record_rooms(record)
        if not self.rooms:
            return rooms
        followed = rooms & self.rooms
        return followed or None


class RoomChange(msgspec.Struct, frozen=True):
    room: int
    before: dict[str, Any] | None
    """The endpoint's summary of the room before the step; null: not open there."""
    after: dict[str, Any] | None


class StepView(msgspec.Struct, frozen=True):
    endpoint: str
    seq: int
    t: float
    input: dict[str, Any]
    error: dict[str, Any] | None
    fired: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    rooms: list[RoomChange]


class LastSeen(msgspec.Struct, frozen=True):
    """The last summary recorded for a room on an endpoint before the room was removed there."""

    seq: int
    t: float
    summary: dict[str, Any]


class RoomOnEndpoint(msgspec.Struct, frozen=True):
    endpoint: str
    role: str
    summary: dict[str, Any] | None
    """Null: the room is not open here (see ``last_seen``)."""
    timer_at: float | None
    draining: list[dict[str, Any]]
    """Prefill: generations the engine cleared while their writes were still in flight."""
    pages: list[dict[str, Any]]
    """Decode: the page ledger's holdings of the room, per generation."""
    quarantined: list[dict[str, Any]]
    """Decode: fenced generations, their pages, the writers awaited and for how long."""
    writers: list[dict[str, Any]]
    """Decode: the prefill ranks that write into the open room's pages."""
    last_seen: LastSeen | None


class EndpointState(msgspec.Struct, frozen=True):
    endpoint: str
    role: str
    timer_at: float | None
    room_timers: dict[int, float]
    """Each open room's armed deadline."""
    snapshot: dict[str, Any]
    """The endpoint's ``snapshot()``: its rooms, counters and (decode) page ledger."""
    quarantined: list[dict[str, Any]]


class StopState(msgspec.Struct, frozen=True):
    at: dict[str, Any] | None
    """The last record replayed (endpoint, seq, t); null when none was."""
    rooms: dict[int, list[RoomOnEndpoint]]
    endpoints: dict[str, EndpointState]


def parse_stop_point(text: str, trace: Trace) -> StopPoint:
    """``ENDPOINT:SEQ`` (an endpoint id may hold colons: the seq is after the last one)."""
    endpoint, colon, seq_text = text.rpartition(":")
    example = f"{trace.records[0].endpoint}:{trace.records[0].seq}" if trace.records else "E:0"
    if not colon or not endpoint or not seq_text.isdigit():
        raise FollowError(f"--until {text!r}: give ENDPOINT:SEQ, e.g. --until {example}")
    check_endpoints([endpoint], trace)
    seqs = [r.seq for r in trace.records if r.endpoint == endpoint]
    seq = int(seq_text)
    if seq not in seqs:
        held = f"seq {min(seqs)} to {max(seqs)}" if seqs else "no records"
        raise FollowError(f"--until {text}: endpoint {endpoint} has {held} in this trace")
    return endpoint, seq


def check_endpoints(endpoints: Iterable[str], trace: Trace) -> None:
    unknown = sorted(set(endpoints) - set(trace.headers))
    if unknown:
        raise FollowError(
            f"no endpoint {', '.join(unknown)} in this trace; its endpoints: "
            f"{', '.join(trace.headers)}"
        )


def check_rooms(rooms: Iterable[int], trace: Trace) -> None:
    wanted = set(rooms)
    present: set[int] = set()
    for record in trace.records:
        present |= record_rooms(record)
        if wanted <= present:
            return
    missing = sorted(wanted - present)
    known = sorted(present)
    listed = ", ".join(map(str, known[:20])) + (f" ... ({len(known)} in all)" if len(known) > 20
                                                else "")  # fmt: skip
    raise FollowError(
        f"no record concerns room {', '.join(map(str, missing))}; the trace's rooms: "
        f"{listed or 'none'} (`pdflow trace show` lists them with their outcomes)"
    )


class Stepper:
    """Replay's hooks for a :class:`Follow`: ``emit`` gets a :class:`StepView` per followed step
    that matched its record; :attr:`diverging` is the followed step that did not, if any."""

    def __init__(self, follow: Follow, emit: Callable[[StepView], None]) -> None:
        self.follow = follow
        self.emit = emit
        self.last_seen: dict[tuple[str, int], LastSeen] = {}
        self._pending: tuple[StepRecord, set[int], dict[int, Any]] | None = None

    @property
    def diverging(self) -> StepRecord | None:
        """The followed record replay stepped last, when it did not match (its hooks ran
        before the step only); None when the last followed step matched."""
        return None if self._pending is None else self._pending[0]

    def before_step(self, record: StepRecord, endpoint: TracedEndpoint) -> None:
        rooms = self.follow.rooms_shown(record)
        if rooms is None:
            return
        before = {room: _builtins(endpoint.summary(room)) for room in rooms}
        self._pending = (record, rooms, before)

    def after_step(self, record: StepRecord, endpoints: dict[str, TracedEndpoint]) -> None:
        self._remember(record)
        if self._pending is None or self._pending[0] is not record:
            return
        _, rooms, before = self._pending
        self._pending = None
        endpoint = endpoints[record.endpoint]
        if self.follow.rooms:
            followed = [f for f in room_fired(record) if f.key in rooms]
            fired = [_builtins(f) for f in followed]
            outputs = [o for o in record.outputs if _output_room(o) in rooms | {None}]
        else:
            fired, outputs = [_builtins(f) for f in record.fired], list(record.outputs)
        self.emit(StepView(
            record.endpoint, record.seq, record.t, _builtins(record.input),
            _builtins(record.error), fired, outputs,
            [RoomChange(room, before[room], _builtins(endpoint.summary(room)))
             for room in sorted(rooms)],
        ))  # fmt: skip

    def _remember(self, record: StepRecord) -> None:
        """Keep each followed room's last recorded summary per endpoint, for rooms that are
        gone where replay stops (a failed room is usually cleared right after failing)."""
        if not self.follow.rooms:
            return
        for entry in record.rooms:
            room, summary = entry["room"], entry["summary"]
            if isinstance(summary, dict) and isinstance(room, int) and room in self.follow.rooms:
                self.last_seen[(record.endpoint, room)] = LastSeen(record.seq, record.t, summary)


def agreed_endpoints(trace: Trace, result: ReplayResult) -> dict[str, TracedEndpoint]:
    """The endpoints after the last step that matched its record. After a divergence, replay's
    own endpoints have also run the diverging step, this core's way; the divergence shows what
    that step did, and the state to read is the one the record and this core agree on, so the
    trace is replayed again up to the last matching record (replay is fast: ~20 us a step)."""
    if result.divergence is None:
        return result.endpoints
    if result.last is None:
        return {name: build_endpoint(header) for name, header in trace.headers.items()}
    again = replay(trace, force=result.skipped_spec_check,
                   until=(result.last.endpoint, result.last.seq))  # fmt: skip
    return again.endpoints


def state_at_stop(
    trace: Trace, result: ReplayResult, follow: Follow, stop: StopPoint | None, stepper: Stepper
) -> StopState:
    """The replayed state of the followed rooms and endpoints after the last matching step: the
    rooms on every followed endpoint; the endpoints followed by name, or the --until endpoint
    when nothing else is followed, or every endpoint for --all-steps."""
    last = result.last
    now = last.t if last is not None else 0.0
    at = None if last is None else {"endpoint": last.endpoint, "seq": last.seq, "t": last.t}
    replayed = agreed_endpoints(trace, result)
    shown = follow.endpoints or set(replayed)
    rooms = {
        room: [state for name in replayed if name in shown
               if (state := room_state(name, replayed[name], room, now,
                                       stepper.last_seen.get((name, room)))) is not None]
        for room in sorted(follow.rooms)
    }  # fmt: skip
    if follow.endpoints:
        named: Iterable[str] = follow.endpoints
    elif follow.every_step:
        named = replayed
    else:
        named = [stop[0]] if stop is not None and not follow.rooms else []
    endpoints = {name: endpoint_state(name, replayed[name], now)
                 for name in replayed if name in named}  # fmt: skip
    return StopState(at, rooms, endpoints)


def room_state(
    name: str, endpoint: TracedEndpoint, room: int, now: float, last_seen: LastSeen | None
) -> RoomOnEndpoint | None:
    """What the endpoint holds of the room; None when it holds nothing and never had it."""
    snapshot = _builtins(endpoint.snapshot())
    draining = [s for s in snapshot.get("draining", ()) if s["room"] == room]
    pages = [h for h in snapshot.get("ledger", {}).get("rooms", ()) if h["room"] == room]
    quarantined, writers = [], []
    if isinstance(endpoint, DecodeEndpoint):
        quarantined = [_builtins(q) for q in endpoint.quarantine(now) if q.room == room]
        writers = _builtins(list(endpoint.writers_of(room)))
    summary = _builtins(endpoint.summary(room))
    if summary is None and not (draining or pages or last_seen):
        return None
    return RoomOnEndpoint(
        name, endpoint.role, summary, _room_timers(endpoint).get(room), draining, pages,
        quarantined, writers, None if summary is not None else last_seen,
    )  # fmt: skip


def endpoint_state(name: str, endpoint: TracedEndpoint, now: float) -> EndpointState:
    quarantined = (
        [_builtins(q) for q in endpoint.quarantine(now)]
        if isinstance(endpoint, DecodeEndpoint)
        else []
    )
    return EndpointState(
        name, endpoint.role, endpoint.timer_at(), dict(sorted(_room_timers(endpoint).items())),
        _builtins(endpoint.snapshot()), quarantined,
    )  # fmt: skip


def _room_timers(endpoint: TracedEndpoint) -> dict[int, float]:
    # The deadline queue's ``armed`` is documented as readable; only the queue writes it.
    return dict(endpoint.deadlines.armed) if isinstance(endpoint, RoomHost) else {}


def _output_room(output: dict[str, Any]) -> int | None:
    """The room an output names, itself or in the message it sends; None: it names none."""
    room = output.get("room")
    message = output.get("message")
    if room is None and isinstance(message, dict):
        room = message.get("room")
    return room if isinstance(room, int) else None


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)
