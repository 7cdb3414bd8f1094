"""The trace format (version 1), shared by the simulator, the nodes and the replay tools.

A trace is JSON lines. Each endpoint's first line is a :class:`TraceHeader`; every later line
is a :class:`StepRecord` of one core step of one endpoint. A file may hold several endpoints
(the simulator writes one file for a whole world); a deployment writes one file per process.
Structs are encoded with msgspec in a deterministic order; bytes appear as base64.
See docs/trace.md.

Compatibility: readers accept every version-1 line written so far. Fields added later get
defaults, so older lines still decode; a reader meeting a newer ``format`` refuses it clearly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    DecodeEndpointConfig,
    PrefillEndpointConfig,
)
from pdflow.core.framework.table import Fired

TRACE_FORMAT_VERSION = 1
CLOCKS = ("virtual", "monotonic")

EndpointConfig = PrefillEndpointConfig | DecodeEndpointConfig


class TraceHeader(msgspec.Struct, frozen=True, tag="header", tag_field="kind"):
    format: int
    endpoint: str
    role: str
    config: EndpointConfig
    spec_version: str
    spec_sha256: str
    pdflow_version: str
    clock: str
    """'virtual' (simulated seconds) or 'monotonic' (the shell's monotonic clock)."""
    seed: int | None = None
    fault_plan: dict[str, object] | None = None
    wall_start: str | None = None
    """Wall-clock start, for humans only; replay never reads it."""
    mutant: str | None = None
    """The mutant core (``pdflow.sim.mutants``) the simulator ran under, by name; None for a
    real core. Replay of such a trace diverges where the mutant acts."""


class StepError(msgspec.Struct, frozen=True):
    """The core refused the input (a ProtocolError, InvalidInput...): the state did not change."""

    kind: str
    message: str


class StepRecord(msgspec.Struct, frozen=True, tag="step", tag_field="kind"):
    seq: int
    """Per endpoint, from 0, with no gaps: a gap means records were lost (e.g. rotated away)."""
    t: float
    """The ``now`` the core was given: virtual seconds or the shell's monotonic clock."""
    endpoint: str
    input: AnyEndpointInput
    outputs: list[dict[str, object]]
    """``msgspec.to_builtins`` of each output, in order."""
    fired: tuple[Fired, ...]
    rooms: list[dict[str, object]]
    """One ``{"room": id, "summary": ...}`` per room the step touched, in room order; the
    summary is ``endpoint.summary(room)`` after the step, null once the room is removed."""
    timer_at: float | None
    error: StepError | None = None


TraceLine = TraceHeader | StepRecord

_ENCODER = msgspec.json.Encoder(order="deterministic")
_SORTED = msgspec.json.Encoder(order="sorted")
_DECODER = msgspec.json.Decoder(TraceLine)


class TraceFormatError(ValueError):
    """A trace line cannot be read; the message names the file and line."""


def message_id(endpoint: str, seq: int, index: int) -> str:
    """The id of output ``index`` of record ``seq`` of ``endpoint``, carried as
    ``Received.msg_id`` by the receiving side so that merged traces keep causal order."""
    return f"{endpoint}:{seq}:{index}"


def parse_message_id(msg_id: str) -> tuple[str, int, int]:
    """The inverse of :func:`message_id` (the endpoint id may itself contain colons)."""
    endpoint, seq, index = msg_id.rsplit(":", 2)
    return endpoint, int(seq), int(index)


def role_of(config: EndpointConfig) -> str:
    return "prefill" if isinstance(config, PrefillEndpointConfig) else "decode"


def encode_line(line: TraceLine | msgspec.Struct) -> bytes:
    """One trace line without its newline, deterministic (equal values give equal bytes)."""
    return _ENCODER.encode(line)


def encode_sorted(value: object) -> bytes:
    """JSON with every key sorted, struct fields included: a struct and its decoded builtins
    (a recorded output) give equal bytes when their values are equal."""
    return _SORTED.encode(value)


def decode_line(data: bytes | str) -> TraceLine:
    line = _DECODER.decode(data)
    if isinstance(line, TraceHeader):
        _check_header(line)
    return line


def _check_header(header: TraceHeader) -> None:
    """What the schema alone lets through: a header whose role or clock replay cannot honour."""
    if header.format > TRACE_FORMAT_VERSION:
        raise TraceFormatError(
            f"trace format {header.format} is newer than this pdflow reads "
            f"({TRACE_FORMAT_VERSION}); upgrade pdflow to read it"
        )
    if header.role != role_of(header.config):
        raise TraceFormatError(
            f"endpoint {header.endpoint}: role {header.role!r} does not match its "
            f"{role_of(header.config)} configuration; the header was edited or is not pdflow's"
        )
    if header.clock not in CLOCKS:
        raise TraceFormatError(
            f"endpoint {header.endpoint}: clock {header.clock!r} is none of {', '.join(CLOCKS)}"
        )


def read_trace(path: Path, torn_tails: list[str] | None = None) -> Iterator[TraceLine]:
    """Every line of one trace file, in file order. Blank lines are skipped. A bad line raises,
    except, when ``torn_tails`` is given, a torn last line (cut before its newline: the process
    died mid-write, the usual state of a crashed node's trace), which is dropped and described
    in ``torn_tails``: never silently."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield decode_line(raw)
            except (msgspec.DecodeError, msgspec.ValidationError, TraceFormatError) as exc:
                if torn_tails is not None and not raw.endswith(b"\n"):  # only a last line can
                    torn_tails.append(f"{path}:{number}: dropped the torn last line ({len(raw)} "
                                      "bytes, no newline): its process stopped mid-write")
                    return
                raise TraceFormatError(f"{path}:{number}: not a trace line: {exc}") from exc


def write_trace(path: Path, lines: Iterable[TraceLine]) -> None:
    """Write lines as a trace file (tests and tools; nodes write through TraceRecorder)."""
    with path.open("wb") as handle:
        for line in lines:
            handle.write(encode_line(line) + b"\n")
