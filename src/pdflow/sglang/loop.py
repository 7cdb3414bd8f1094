"""pdflow's event loop in a thread beside SGLang's scheduler.

SGLang's scheduler is a synchronous loop: every call it makes into a transfer backend must
return at once. pdflow's nodes are async (anyio on asyncio). :class:`LoopThread` runs one event
loop in a daemon thread (anyio's blocking portal) and offers two ways in:

* :meth:`LoopThread.submit` queues a coroutine call and returns immediately. Calls run one at a
  time in submission order, so a room's ``open``, ``init_transfer`` and chunks reach the core in
  the order the scheduler made them; a call that raises is reported to its ``on_error``. The
  loop is woken once for however many calls the scheduler queued before it ran (one
  ``call_soon_threadsafe`` per burst, not per call: each wake is a self-pipe write and a thread
  switch, which were a per-room cost of every scheduler tick).
* :meth:`LoopThread.spawn` starts a coroutine call as its own task, beside the command queue
  (for waits that must not hold up the queue, like a topology fetch); returns immediately.
* :meth:`LoopThread.call` blocks until a coroutine finishes: only for start-up and shutdown,
  never from the scheduler's per-request path. (The portal's own ``start_task_soon`` also waits
  for the loop to take the task, so the scheduler's path never uses it.)
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog
from anyio.from_thread import BlockingPortal

from pdflow.io.control import YIELD_EVERY

log = structlog.get_logger("pdflow.sglang.loop")

T = TypeVar("T")
ErrorHandler = Callable[[BaseException], None]
Command = tuple[Callable[..., Awaitable[None]], tuple[Any, ...], ErrorHandler]


class LoopThread:
    """One asyncio event loop in its own thread, with an ordered command queue."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._portal_cm: AbstractContextManager[BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(backend="asyncio")
        )
        self._portal = self._portal_cm.__enter__()
        self._loop: asyncio.AbstractEventLoop = self._portal.call(asyncio.get_running_loop)
        # Commands wait here (deque appends and pops are atomic); the lock guards only whether a
        # wake-up of the loop is already on its way.
        self._pending: deque[Command] = deque()
        self._wake_lock = threading.Lock()
        self._wake_scheduled = False
        self._stopping = False
        self._woken: asyncio.Event = self._portal.call(_new_event)
        self._portal.start_task_soon(self._run_commands)
        self._closed = threading.Event()
        self._spawned: set[asyncio.Task[None]] = set()

    @property
    def portal(self) -> BlockingPortal:
        return self._portal

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and wait for its result (start-up and shutdown only)."""
        return self._portal.call(fn, *args)

    def submit(self, fn: Callable[..., Awaitable[None]], on_error: ErrorHandler,
               *args: Any) -> None:  # fmt: skip
        """Queue ``fn(*args)``; returns at once. Commands run in order, one at a time.

        The arguments travel with the call, so a caller needs no closure (a function, its
        cells and a second coroutine) per call: the scheduler makes several per room."""
        if self._closed.is_set():
            on_error(RuntimeError(f"{self.name}: the pdflow loop is shut down"))
            return
        self._pending.append((fn, args, on_error))
        with self._wake_lock:
            if self._wake_scheduled:
                return  # the loop has not drained yet: it will find this one too
            self._wake_scheduled = True
        self._loop.call_soon_threadsafe(self._woken.set)

    def spawn(self, fn: Callable[[], Awaitable[None]], on_error: ErrorHandler) -> None:
        """Run ``fn()`` as its own task on the loop; returns at once."""
        if self._closed.is_set():
            on_error(RuntimeError(f"{self.name}: the pdflow loop is shut down"))
            return
        self._loop.call_soon_threadsafe(self._start_task, fn, on_error)

    def _start_task(self, fn: Callable[[], Awaitable[None]], on_error: ErrorHandler) -> None:
        async def guarded() -> None:
            try:
                await fn()
            except Exception as exc:
                on_error(exc)

        task = self._loop.create_task(guarded())
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def _cancel_spawned(self) -> None:
        for task in list(self._spawned):
            task.cancel()

    async def _run_commands(self) -> None:
        pending = self._pending
        while True:
            await self._woken.wait()
            self._woken.clear()
            with self._wake_lock:
                # From here on a new submit wakes the loop again; what is queued now runs below.
                self._wake_scheduled = False
            ran = 0
            while pending:
                fn, args, on_error = pending.popleft()
                try:
                    await fn(*args)
                except Exception as exc:
                    try:
                        on_error(exc)
                    except Exception:  # a broken handler must not stop every later call
                        log.exception("pdflow_call_error_handler_failed", error=str(exc))
                ran += 1
                if ran % YIELD_EVERY == 0:
                    # A call need not yield (a refused or answered-at-once one does not): let
                    # the channels and timers run between bursts.
                    await anyio.lowlevel.checkpoint()
            if self._stopping:
                return

    async def _stop_commands(self) -> None:
        """Run what is queued, then end the command task (queued calls still run, in order)."""
        self._stopping = True
        self._woken.set()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._portal.call(self._cancel_spawned)
            self._portal.call(self._stop_commands)
        finally:
            self._portal_cm.__exit__(None, None, None)


async def _new_event() -> asyncio.Event:
    return asyncio.Event()  # made on the loop it is waited on
