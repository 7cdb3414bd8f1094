"""A virtual clock: simulated seconds that move only when the simulator says so."""

from __future__ import annotations


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        if seconds <= 0:
            raise ValueError(f"time only moves forward; got a step of {seconds} s")
        self.now += seconds
        return self.now

    def advance_to(self, deadline: float) -> float:
        """Jump to ``deadline`` (a no-op when it is already past)."""
        self.now = max(self.now, deadline)
        return self.now
