"""Record core steps as trace lines: stamp, build the typed record, encode, write.

The core never logs; whoever drives an endpoint (the I/O shell, the simulator) hands each step
to a :class:`TraceRecorder`, or wraps the endpoint in a :class:`RecordingEndpoint` that does it.
Each step: stamp seq and time (never wall time) -> build the typed StepRecord -> encode with
msgspec (deterministic order; an unknown object raises instead of being stringified) -> one
write to a size-bounded, rotating file (or memory). This runs on every protocol step, so it is
straight calls, not a structlog processor chain (the chain cost more than the encoding; the
bytes are the same). A disabled recorder does nothing, and ``wrap`` then returns the bare
endpoint, so switching tracing off costs nothing per step.

Outputs and room summaries are encoded as the structs they are (the same JSON values as their
``msgspec.to_builtins``, with a struct's keys in field order): converting them first cost more
than encoding them. With ``defer``, a step only keeps its record's parts (inputs, outputs and
summaries are frozen structs, so they cannot change meanwhile) and the lines are encoded and
written together a little later: ``defer(write_pending)`` is called when the first record of a
batch is kept, and the batch is written at ``MAX_PENDING`` records, at ``flush``/``close``, and
before a refused input's record (which is flushed at once) or a new endpoint's header, so the
file's order is the steps' order. The node shell defers onto its event loop's next idle point
(``NodeRuntime``, ``pdflow.loop_idle``): a 1 MiB room's three steps on its path were 0.02-0.03
ms longer each with the recorder on (benchmarks/README.md, fifth pass).

Not thread-safe: one recorder per event loop (the shell) or per simulated world.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import msgspec

import pdflow
from pdflow.core.endpoints.endpoint_io import AnyEndpointInput
from pdflow.core.framework.step import Step
from pdflow.spec import load_spec, spec_sha256
from pdflow.trace.format import (
    CLOCKS,
    TRACE_FORMAT_VERSION,
    EndpointConfig,
    StepError,
    StepRecord,
    TraceHeader,
    encode_line,
    role_of,
)
from pdflow.trace.observe import TracedEndpoint, touched_rooms
from pdflow.trace.sink import RotatingLineFile

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_BACKUPS = 3
MAX_PENDING = 256
"""Deferred records kept before they are written whatever the deferral said."""

# One step's record before it is encoded: seq, t, endpoint, input, outputs, fired, rooms
# (room id and summary struct, or None once removed), timer_at, error.
_Pending = tuple[int, float, str, AnyEndpointInput, Sequence[Any], Any, Sequence[Any],
                 float | None, StepError | None]  # fmt: skip


class MemoryLines:
    """The in-memory sink (``TraceRecorder(None)``): the simulator keeps a world's trace and
    writes it out only when a run fails."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def add_preamble(self, line: bytes) -> None:
        self.lines.append(line)

    def msg(self, line: bytes) -> None:
        self.lines.append(line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(line + b"\n" for line in self.lines))


class _Stamp:
    """Per-endpoint seq, and the step's time (virtual, or the monotonic clock)."""

    def __init__(self, clock: str) -> None:
        self.clock = clock
        self.next_seq: dict[str, int] = {}

    def time_of(self, t: float | None) -> float:
        if t is not None:
            return t
        if self.clock == "virtual":
            raise ValueError("a virtual-clock trace needs the step's time: pass t=now")
        return time.monotonic()


class TraceRecorder:
    """Writes one trace file (or memory, with ``path=None``) for one or more endpoints."""

    def __init__(
        self,
        path: Path | str | None,
        *,
        clock: str = "monotonic",
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        enabled: bool = True,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """``defer``: given :meth:`write_pending`, arrange for it to run soon (e.g. on the
        event loop a little later); without it every step is written at once."""
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        self.enabled = enabled
        self.clock = clock
        self.path = Path(path) if path is not None else None
        self._sink: RotatingLineFile | MemoryLines | None = None
        self._stamp = _Stamp(clock)
        self._spec: tuple[str, str] | None = None
        self._defer = defer
        self._pending: list[_Pending] = []
        if not enabled:
            return
        self._sink = (
            MemoryLines()
            if self.path is None
            else RotatingLineFile(self.path, max_bytes=max_bytes, backups=backups)
        )
        self._encode = msgspec.json.Encoder(order="deterministic").encode

    # ---- endpoints -------------------------------------------------------------------------------
    def add_endpoint(
        self,
        endpoint_id: str,
        role: str,
        config: EndpointConfig,
        seed: int | None = None,
        fault_plan: dict[str, object] | None = None,
    ) -> TraceHeader | None:
        """Write the endpoint's header. Call once per endpoint, before its first step."""
        if role != role_of(config):
            raise ValueError(
                f"endpoint {endpoint_id}: role {role!r} but a {role_of(config)} config"
            )
        if endpoint_id in self._stamp.next_seq:
            raise ValueError(f"endpoint {endpoint_id} is already in this trace")
        self._stamp.next_seq[endpoint_id] = 0
        if self._sink is None:
            return None
        self.write_pending()  # the steps recorded so far precede this header in the file
        spec_version, sha = self._spec_identity()
        header = TraceHeader(
            format=TRACE_FORMAT_VERSION,
            endpoint=endpoint_id,
            role=role,
            config=config,
            spec_version=spec_version,
            spec_sha256=sha,
            pdflow_version=pdflow.__version__,
            clock=self.clock,
            seed=seed,
            fault_plan=fault_plan,
            wall_start=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        self._sink.add_preamble(encode_line(header))
        return header

    def wrap(
        self,
        endpoint_id: str,
        endpoint: TracedEndpoint,
        seed: int | None = None,
        fault_plan: dict[str, object] | None = None,
    ) -> TracedEndpoint:
        """Add the endpoint and return a recording wrapper, or the endpoint itself when off."""
        if not self.enabled:
            return endpoint
        self.add_endpoint(endpoint_id, endpoint.role, endpoint.config, seed, fault_plan)
        return RecordingEndpoint(endpoint_id, endpoint, self, registered=True)

    # ---- steps -----------------------------------------------------------------------------------
    def record(
        self,
        endpoint_id: str,
        t: float | None,
        input: AnyEndpointInput,
        step: Step,
        rooms: list[dict[str, object]],
    ) -> int | None:
        """Record one step; returns its seq (None when off). ``rooms`` is
        :func:`pdflow.trace.observe.room_summaries` of the rooms the step touched."""
        if self._sink is None:
            return None
        return self._emit(endpoint_id, t, input, step.outputs, step.fired, rooms, step.timer_at,
                          None)  # fmt: skip

    def record_step(
        self,
        endpoint_id: str,
        t: float | None,
        input: AnyEndpointInput,
        step: Step,
        summaries: Sequence[tuple[int, msgspec.Struct | None]],
    ) -> int | None:
        """``record`` with each touched room's summary as the endpoint returned it (a frozen
        struct, or None once the room is removed), in room order."""
        if self._sink is None:
            return None
        return self._emit(endpoint_id, t, input, step.outputs, step.fired, summaries,
                          step.timer_at, None)  # fmt: skip

    def record_error(
        self,
        endpoint_id: str,
        t: float | None,
        input: AnyEndpointInput,
        error: BaseException,
        rooms: list[dict[str, object]] | Sequence[tuple[int, msgspec.Struct | None]],
        timer_at: float | None,
    ) -> int | None:
        """Record an input the core refused (its state did not change). Flushes at once.
        ``rooms`` as ``record`` or ``record_step`` take them."""
        if self._sink is None:
            return None
        seq = self._emit(
            endpoint_id, t, input, (), (), rooms, timer_at,
            StepError(type(error).__name__, str(error)),
        )  # fmt: skip
        self.flush()
        return seq

    def next_seq(self, endpoint_id: str) -> int:
        """The seq the endpoint's next record will get (for message ids of a step in flight)."""
        return self._stamp.next_seq[endpoint_id]

    def _emit(
        self, endpoint_id: str, t: float | None, input: AnyEndpointInput, outputs: Any,
        fired: Any, rooms: Any, timer_at: float | None, error: StepError | None,
    ) -> int:  # fmt: skip
        next_seq = self._stamp.next_seq
        seq = next_seq.get(endpoint_id)
        if seq is None:
            raise ValueError(f"endpoint {endpoint_id} has no header: call add_endpoint first")
        stamped = self._stamp.time_of(t)
        next_seq[endpoint_id] = seq + 1
        entry = (seq, stamped, endpoint_id, input, outputs, fired, rooms, timer_at, error)
        if self._defer is None:
            self._write(entry)
            return seq
        pending = self._pending
        pending.append(entry)
        if len(pending) == 1:
            self._defer(self.write_pending)
        elif len(pending) >= MAX_PENDING:
            self.write_pending()
        return seq

    def write_pending(self) -> None:
        """Encode and write the records kept so far (``defer``); nothing when none are."""
        pending, self._pending = self._pending, []
        for entry in pending:
            self._write(entry)

    def _write(self, entry: _Pending) -> None:
        seq, stamped, endpoint_id, input, outputs, fired, rooms, timer_at, error = entry
        # The output structs encode as the dicts a reader decodes them to (StepRecord.outputs).
        record = StepRecord(
            seq=seq, t=stamped, endpoint=endpoint_id, input=input,
            outputs=cast(list[dict[str, object]], outputs),
            fired=fired, rooms=[room if isinstance(room, dict) else
                                {"room": room[0], "summary": room[1]} for room in rooms],
            timer_at=timer_at, error=error,
        )  # fmt: skip
        assert self._sink is not None  # only an enabled recorder emits
        self._sink.msg(self._encode(record))

    # ---- lifetime --------------------------------------------------------------------------------
    @property
    def lines(self) -> list[bytes]:
        """The recorded lines of an in-memory recorder."""
        if not isinstance(self._sink, MemoryLines):
            raise TypeError("only TraceRecorder(None) keeps its lines in memory")
        self.write_pending()
        return self._sink.lines

    def dump(self, path: Path) -> None:
        """Write an in-memory recorder's trace to a file."""
        if not isinstance(self._sink, MemoryLines):
            raise TypeError("only TraceRecorder(None) keeps its lines in memory")
        self.write_pending()
        self._sink.dump(path)

    @property
    def rotations(self) -> int:
        return self._sink.rotations if isinstance(self._sink, RotatingLineFile) else 0

    def flush(self) -> None:
        if self._sink is not None:
            self.write_pending()
            self._sink.flush()

    def close(self) -> None:
        if self._sink is not None:
            self.write_pending()
            self._sink.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spec_identity(self) -> tuple[str, str]:
        if self._spec is None:
            self._spec = (load_spec().spec_version, spec_sha256())
        return self._spec


class RecordingEndpoint:
    """Wraps a PrefillEndpoint or DecodeEndpoint: ``handle`` records every step, and records an
    input the core refuses (ProtocolError, InvalidInput...) as ``error`` before re-raising it."""

    def __init__(
        self,
        endpoint_id: str,
        endpoint: TracedEndpoint,
        recorder: TraceRecorder,
        *,
        registered: bool = False,
    ) -> None:
        self.endpoint_id = endpoint_id
        self.inner = endpoint
        self.recorder = recorder
        self.last_seq: int | None = None
        """Seq of the last recorded step: SendMessage output i of it has id
        ``message_id(endpoint_id, last_seq, i)``."""
        if not registered:
            recorder.add_endpoint(endpoint_id, endpoint.role, endpoint.config)

    @property
    def role(self) -> str:
        return self.inner.role

    @property
    def config(self) -> EndpointConfig:
        return self.inner.config

    def handle(self, inp: AnyEndpointInput, now: float) -> Step:
        endpoint = self.inner
        if not self.recorder.enabled:
            return endpoint.handle(inp, now)
        try:
            step = endpoint.handle(inp, now)
        except Exception as exc:
            refused = [(room, endpoint.summary(room)) for room in touched_rooms(inp, None)]
            self.last_seq = self.recorder.record_error(
                self.endpoint_id, now, inp, exc, refused, endpoint.timer_at()
            )
            raise
        summaries = [(room, endpoint.summary(room)) for room in touched_rooms(inp, step)]
        self.last_seq = self.recorder.record_step(self.endpoint_id, now, inp, step, summaries)
        return step

    def summary(self, room_id: int) -> msgspec.Struct | None:
        return self.inner.summary(room_id)

    def timer_at(self) -> float | None:
        return self.inner.timer_at()

    def snapshot(self) -> msgspec.Struct:
        return self.inner.snapshot()

    def __getattr__(self, name: str) -> Any:
        # snapshot(), rooms, counters, ledger... read straight from the wrapped endpoint.
        return getattr(self.inner, name)
