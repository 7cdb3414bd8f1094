"""Work an event loop does at its idle points: now-or-later housekeeping off a room's path.

Some work must happen soon but on no room's critical path: the nodes' trace batches
(``TraceRecorder(defer=...)``). :func:`defer` keeps it for the running loop; it runs at the
loop's next *idle point*, declared with :func:`idle_point` by the code that knows the loop
has nothing of a room's path to do for a while (a transport handing a write to a worker
thread with the bytes on the wire; a decode that just published a room's terminal status,
once the waiters it woke have run), or ``delay`` seconds after the first work was kept when no
idle point came first. Idle points are declared, not guessed: an empty ready queue on the loop
is also the moment a control message is about to arrive (benchmarks/README.md, 2026-12-03).

Per loop, so every node on one loop (tests and benchmarks run two) has its work done at any of
their idle points. Outside a running loop the work runs at once.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

DEFAULT_DELAY_S = 0.005
"""The latest a kept piece of work runs after the first one of its batch, without an idle
point."""


class _IdleWork:
    """One loop's kept work. Refers to no loop (the loop's handles refer to it), so the registry
    never keeps a closed loop alive."""

    def __init__(self) -> None:
        self._work: list[Callable[[], None]] = []
        self._batch = 0  # which batch a scheduled run is for: a later one skips it
        self._soon_for = -1

    def defer(self, work: Callable[[], None], delay: float) -> None:
        self._work.append(work)
        if len(self._work) == 1:
            asyncio.get_running_loop().call_later(delay, self._due, self._batch)

    def idle_point(self) -> None:
        if self._work and self._soon_for != self._batch:
            self._soon_for = self._batch
            asyncio.get_running_loop().call_soon(self._due, self._batch)

    def _due(self, batch: int) -> None:
        if batch != self._batch:
            return  # done already (the other of its two schedules came first)
        work, self._work = self._work, []
        self._batch += 1
        for run in work:
            try:
                run()
            except Exception as exc:  # one failure leaves the rest of the batch to run
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "deferred idle work failed", "exception": exc}
                )


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _IdleWork] = (
    weakref.WeakKeyDictionary()
)


def defer(work: Callable[[], None], delay: float = DEFAULT_DELAY_S) -> None:
    """Run ``work()`` on the running loop at its next idle point, or ``delay`` seconds after
    the first work of its batch was kept, whichever comes first (at once outside a loop)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        work()
        return
    kept = _loops.get(loop)
    if kept is None:
        kept = _loops[loop] = _IdleWork()
    kept.defer(work, delay)


def idle_point() -> None:
    """Declare that the running loop is at an idle point: the work kept so far runs on its next
    pass, after the callbacks ready now (a task woken just before this runs first). A no-op
    with nothing kept, or outside a loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    kept = _loops.get(loop)
    if kept is not None:
        kept.idle_point()
