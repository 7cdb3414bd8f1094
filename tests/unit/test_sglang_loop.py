"""LoopThread, the event loop beside SGLang's scheduler: calls run in order, and a burst of
calls wakes the loop once (counted, never timed)."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import anyio.to_thread

from pdflow.io.control import YIELD_EVERY
from pdflow.sglang.loop import LoopThread


def test_a_burst_of_calls_runs_in_order_and_wakes_the_loop_once() -> None:
    loop = LoopThread("test-loop")
    wakes = 0
    original = loop._loop.call_soon_threadsafe

    scheduler = threading.current_thread()

    def counting(*args: object) -> object:
        nonlocal wakes
        wakes += threading.current_thread() is scheduler  # not the worker thread's own hand-back
        return original(*args)  # type: ignore[arg-type]

    loop._loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    release, ran, errors = threading.Event(), list[int](), list[BaseException]()
    done = threading.Event()

    async def hold() -> None:
        await anyio.to_thread.run_sync(release.wait)

    def call(index: int):  # type: ignore[no-untyped-def]
        async def run() -> None:
            ran.append(index)
            if index == 99:
                done.set()

        return run

    try:
        loop.submit(hold, errors.append)
        for index in range(100):  # queued while the loop is busy with the first call
            loop.submit(call(index), errors.append)
        release.set()
        assert done.wait(30), f"only {len(ran)} of 100 calls ran"
        submitted_wakes = wakes  # close() below talks to the loop too
    finally:
        loop.close()
    assert ran == list(range(100)) and not errors
    # One wake for the first call; the hundred queued behind it share at most one more.
    assert submitted_wakes <= 2, f"{submitted_wakes} wake-ups for 101 calls"


def test_a_failing_call_is_reported_and_the_next_still_runs() -> None:
    loop = LoopThread("test-loop")
    errors: list[BaseException] = []
    done = threading.Event()

    async def fails() -> None:
        raise ValueError("refused")

    async def after() -> None:
        done.set()

    try:
        loop.submit(fails, errors.append)
        loop.submit(after, errors.append)
        assert done.wait(30)
    finally:
        loop.close()
    assert [str(e) for e in errors] == ["refused"]


def test_an_error_handler_that_raises_does_not_stop_the_calls_after_it() -> None:
    loop = LoopThread("test-loop")
    done = threading.Event()

    async def fails() -> None:
        raise ValueError("refused")

    def broken_handler(exc: BaseException) -> None:
        raise RuntimeError("the handler itself is broken")

    async def after() -> None:
        done.set()

    try:
        loop.submit(fails, broken_handler)
        loop.submit(after, broken_handler)
        assert done.wait(30), "the call queued after the broken handler never ran"
    finally:
        loop.close()


def test_calls_queued_before_close_still_run() -> None:
    loop = LoopThread("test-loop")
    ran: list[int] = []
    for index in range(20):

        async def run(index: int = index) -> None:
            await anyio.sleep(0)
            ran.append(index)

        loop.submit(run, lambda exc: None)
    loop.close()
    assert ran == list(range(20))


def test_a_burst_of_calls_that_never_yield_lets_other_tasks_run_between_them() -> None:
    """A node call may finish without yielding (its endpoint lock is taken without a
    checkpoint): the command loop yields every YIELD_EVERY calls, so the node's channels and
    timers are not held up for a whole burst of the scheduler's calls."""
    loop = LoopThread("test-loop")
    burst = 20 * YIELD_EVERY
    ticks = 0
    seen: list[int] = []
    stop, done = threading.Event(), threading.Event()
    release = threading.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async def hold() -> None:
        await anyio.to_thread.run_sync(release.wait)

    def call(index: int):  # type: ignore[no-untyped-def]
        async def run() -> None:  # never awaits anything
            if index in (0, burst - 1):
                seen.append(ticks)
            if index == burst - 1:
                done.set()

        return run

    try:
        loop.spawn(ticker, lambda exc: None)
        loop.submit(hold, lambda exc: None)  # the burst queues up behind this call
        for index in range(burst):
            loop.submit(call(index), lambda exc: None)
        release.set()
        assert done.wait(10)
        first, last = seen
        assert last - first >= burst // YIELD_EVERY - 2, f"the ticker ran {last - first} times"
    finally:
        stop.set()
        loop.close()


def test_a_call_runs_with_the_arguments_it_was_queued_with() -> None:
    loop = LoopThread("test-loop")
    ran: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    async def record(index: int, label: str) -> None:
        ran.append((index, label))
        if index == 9:
            done.set()

    try:
        for index in range(10):
            loop.submit(record, errors.append, index, f"room-{index}")
        assert done.wait(30), f"only {len(ran)} of 10 calls ran"
    finally:
        loop.close()
    assert ran == [(index, f"room-{index}") for index in range(10)] and not errors
