"""Real traces for the trace tests: a hand-wired prefill and decode endpoint on a virtual clock."""

from __future__ import annotations

from pathlib import Path

from pdflow.trace.format import StepRecord, TraceHeader, read_trace, write_trace
from pdflow.trace.recorder import TraceRecorder
from pdflow.trace.synthetic import SyntheticWorld

# Every script at least once, in an order that interleaves rooms on both endpoints.
SCRIPTS = ["ok", "abort", "ok", "fail", "misuse", "ok", "timeout", "ok", "abort", "fail", "ok"]


def record_world(path: Path, scripts: list[str] = SCRIPTS, **recorder_args: object) -> Path:
    with TraceRecorder(path, clock="virtual", **recorder_args) as recorder:  # type: ignore[arg-type]
        SyntheticWorld(recorder, scripts, seed=7).run()
    return path


def lines_of(path: Path) -> list[TraceHeader | StepRecord]:
    return list(read_trace(path))


def rewrite(path: Path, lines: list[TraceHeader | StepRecord]) -> Path:
    write_trace(path, lines)
    return path
