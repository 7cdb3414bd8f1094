"""The trace format (version 1), shared by the simulator, the nodes and the replay tools.

A trace is JSON lines. Each endpoint's first line is a :class:`TraceHeader`; every later line
is a :class:`StepRecord` of one core step of one endpoint. A file may hold several endpoints
(the simulator writes one file for a whole world); a deployment writes one file per process.
Structs are encoded with msgspec in a deterministic order; bytes appear as base64.
See docs/trace.md.
"""

from __future__ import annotations

import msgspec

from pdflow.core.endpoint_io import (
    AnyEndpointInput,
    DecodeEndpointConfig,
    PrefillEndpointConfig,
)
from pdflow.core.table import Fired

TRACE_FORMAT_VERSION = 1


class TraceHeader(msgspec.Struct, frozen=True, tag="header", tag_field="kind"):
    format: int
    endpoint: str
    role: str
    config: PrefillEndpointConfig | DecodeEndpointConfig
    spec_version: str
    spec_sha256: str
    pdflow_version: str
    clock: str
    """'virtual' (simulated seconds) or 'monotonic' (the shell's monotonic clock)."""
    seed: int | None = None
    fault_plan: dict[str, object] | None = None
    wall_start: str | None = None
    """Wall-clock start, for humans only; replay never reads it."""


class StepError(msgspec.Struct, frozen=True):
    kind: str
    message: str


class StepRecord(msgspec.Struct, frozen=True, tag="step", tag_field="kind"):
    seq: int
    t: float
    endpoint: str
    input: AnyEndpointInput
    outputs: list[dict[str, object]]
    fired: tuple[Fired, ...]
    rooms: list[dict[str, object]]
    timer_at: float | None
    error: StepError | None = None


TraceLine = TraceHeader | StepRecord
