"""A minimal trace writer for simulated worlds, in the format of :mod:`pdflow.trace.format`.

The simulator keeps one world's trace in memory (a header per endpoint life, then one
StepRecord per core step) and writes it out when asked, typically on a failure. Encoding is
deterministic, so two runs of one seed give byte-identical traces.
"""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec

import pdflow
from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    DecodeEndpointConfig,
    PrefillEndpointConfig,
)
from pdflow.core.framework.table import Fired
from pdflow.core.protocol.outputs import Output
from pdflow.spec.load import load_spec, spec_sha256
from pdflow.trace.format import TRACE_FORMAT_VERSION, StepError, StepRecord, TraceHeader

_ENCODER = msgspec.json.Encoder(order="deterministic")


@functools.cache
def _spec_identity() -> tuple[str, str]:
    return load_spec().spec_version, spec_sha256()


class TraceWriter:
    def __init__(
        self, seed: int | None, fault_plan: dict[str, object] | None, mutant: str | None = None
    ) -> None:
        self.seed = seed
        self.fault_plan = fault_plan
        self.mutant = mutant
        self.lines: list[bytes] = []
        self.next_seq: dict[str, int] = {}

    def header(
        self, endpoint: str, role: str, config: PrefillEndpointConfig | DecodeEndpointConfig
    ) -> None:
        self.next_seq[endpoint] = 0
        version, sha = _spec_identity()
        self._add(
            TraceHeader(
                format=TRACE_FORMAT_VERSION,
                endpoint=endpoint,
                role=role,
                config=config,
                spec_version=version,
                spec_sha256=sha,
                pdflow_version=pdflow.__version__,
                clock="virtual",
                seed=self.seed,
                fault_plan=self.fault_plan,
                mutant=self.mutant,
            )
        )

    def step(
        self,
        t: float,
        endpoint: str,
        inp: AnyEndpointInput,
        outputs: tuple[Output, ...],
        fired: tuple[Fired, ...],
        rooms: list[dict[str, object]],
        timer_at: float | None,
        error: Exception | None = None,
    ) -> int:
        """Record one step; returns its per-endpoint sequence number (messages it sent are named
        ``<endpoint>:<seq>:<index>``)."""
        seq = self.next_seq[endpoint]
        self.next_seq[endpoint] = seq + 1
        self._add(
            StepRecord(
                seq=seq,
                t=t,
                endpoint=endpoint,
                input=inp,
                outputs=[msgspec.to_builtins(o) for o in outputs],
                fired=fired,
                rooms=rooms,
                timer_at=timer_at,
                error=None if error is None else StepError(type(error).__name__, str(error)),
            )
        )
        return seq

    def _add(self, line: TraceHeader | StepRecord) -> None:
        self.lines.append(_ENCODER.encode(line))

    def to_bytes(self) -> bytes:
        return b"".join(line + b"\n" for line in self.lines)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.to_bytes())
        return path
