"""Per-peer accounting of writes in flight, so that closing a session can wait for them."""

from __future__ import annotations

from collections import Counter

import anyio


class InflightWrites:
    """Counts `batch_write` calls in flight per peer and wakes waiters when a peer goes idle.

    Must be used from one event loop; `enter`/`leave` are plain calls so they can sit in
    `try/finally` around a write without awaiting.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._idle_events: dict[str, anyio.Event] = {}

    def count(self, peer: str | None = None) -> int:
        """Writes in flight to `peer`, or to every peer when `peer` is None."""
        if peer is None:
            return sum(self._counts.values())
        return self._counts[peer]

    def enter(self, peer: str) -> None:
        self._counts[peer] += 1

    def leave(self, peer: str) -> None:
        self._counts[peer] -= 1
        if self._counts[peer] == 0:
            del self._counts[peer]
            event = self._idle_events.pop(peer, None)
            if event is not None:
                event.set()

    async def wait_idle(self, peer: str) -> None:
        """Return once no write to `peer` is in flight."""
        while self._counts[peer] > 0:
            event = self._idle_events.get(peer)
            if event is None:
                event = self._idle_events[peer] = anyio.Event()
            await event.wait()

    async def wait_all_idle(self) -> None:
        """Return once no write to any peer is in flight."""
        while self._counts:
            await self.wait_idle(next(iter(self._counts)))
