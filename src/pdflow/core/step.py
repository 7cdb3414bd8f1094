"""The result of one core step: effects as data, the transitions taken, and the next deadline."""

from __future__ import annotations

import msgspec

from pdflow.core.outputs import Output
from pdflow.core.table import Fired


class Step(msgspec.Struct, frozen=True):
    outputs: tuple[Output, ...] = ()
    timer_at: float | None = None
    fired: tuple[Fired, ...] = ()


def earliest(*deadlines: float | None) -> float | None:
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None
