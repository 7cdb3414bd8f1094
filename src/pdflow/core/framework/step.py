"""The result of one core step: effects as data, the transitions taken, and the next deadline."""

from __future__ import annotations

import msgspec

from pdflow.core.protocol.outputs import Output


class Fired(msgspec.Struct, frozen=True, gc=False):
    """One transition taken, as recorded in steps, traces and coverage."""

    machine: str
    key: int
    source: str
    on: str
    guard: str | None
    target: str


class Step(msgspec.Struct, frozen=True, gc=False):
    outputs: tuple[Output, ...] = ()
    timer_at: float | None = None
    fired: tuple[Fired, ...] = ()

