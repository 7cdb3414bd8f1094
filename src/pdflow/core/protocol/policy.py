"""Configuration shared by both sides: allocation policy and timer defaults."""

from __future__ import annotations

import enum

import msgspec


class AllocationPolicy(enum.StrEnum):
    """When the decode reserves destination pages."""

    EARLY = "early"
    """Reserve at once; the prefill computes only after it has the destination."""
    PREFILL_COMPLETE = "prefill_complete"
    """Wait for the prefill's ready signal, then reserve (decode memory is held for less time)."""


class Timeouts(msgspec.Struct, frozen=True):
    """Timer budgets in seconds. Names match ``[timers]`` in spec/protocol.toml."""

    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("bootstrap_timeout", "waiting_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive seconds")
