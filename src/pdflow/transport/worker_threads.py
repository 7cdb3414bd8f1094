"""Long-lived threads that run a transport's blocking engine calls for its event loop.

``anyio.to_thread.run_sync`` costs about 120 us per call on the 2-core machines here (80 us into
the thread: its limiter's checkpoint, the idle-worker bookkeeping, a context copy; 40 us back);
a room of 1 MiB spends about 0.6 ms on the wire, so that was a fifth of it again. Here a call
is one ``SimpleQueue.put`` into a waiting thread and one ``call_soon_threadsafe`` back (about
55 us both ways, benchmarks/README.md "Fifth pass").

The threads keep Linux's default 50 us timer slack, which makes the poll loop's 20 us pause
last about 100 us: a 1 us slack saw a write's completion sooner, but the more frequent polls
took CPU from the engine's io threads (256 MiB in 4 ops: 187 -> 220 ms, process CPU 242 ->
316 ms, same run).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

_Call = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # never: the caller waits shielded; guard anyway
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class WorkerThreads:
    """``size`` daemon threads, started on first use; each runs one call at a time, in the
    order the calls were made. ``close`` lets them end once the calls queued so far are done."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"need at least one worker thread, got {size}")
        self._size = size
        self._name = name
        self._calls: SimpleQueue[_Call | None] = SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    async def run(self, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` in a worker thread. Once queued it is always seen through: cancelling
        the caller waits for it to return (what a fence needs of a write)."""
        self.check_open()
        if not self._threads:
            self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, future, func, args))
        with anyio.CancelScope(shield=True):
            result = await future
        return result

    def check_open(self) -> None:
        """Raise as ``run`` would once closed: call it before starting work that ``run`` must
        then see through (a write submitted on the loop, polled in the thread)."""
        if self._closed:
            raise RuntimeError(f"{self._name} worker threads are closed")

    def _start(self) -> None:
        for index in range(self._size):
            thread = threading.Thread(target=self._serve, name=f"{self._name}-{index}",
                                      daemon=True)  # fmt: skip
            thread.start()
            self._threads.append(thread)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, func, args = call
            result, error = None, None
            try:
                result = func(*args)
            except BaseException as exc:  # handed to the caller, which re-raises it
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(_settle, future, result, error)

    def close(self) -> None:
        """No more calls; each thread ends after the calls already queued."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._calls.put(None)
