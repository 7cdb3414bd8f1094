"""WorkerThreads, the transport's long-lived threads for blocking engine calls: results and
errors come back, a cancelled caller still waits for its call, and the threads end on close."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from pdflow.transport.worker_threads import WorkerThreads


def test_a_call_runs_in_a_worker_thread_and_returns_its_result() -> None:
    threads = WorkerThreads(2, "test-workers")

    async def main() -> tuple[int, str]:
        return await threads.run(lambda a, b: (a + b, threading.current_thread().name), 2, 3)

    try:
        total, name = anyio.run(main, backend="asyncio")
    finally:
        threads.close()
    assert total == 5
    assert name.startswith("test-workers-")


def test_an_error_in_the_call_is_raised_to_the_caller() -> None:
    threads = WorkerThreads(1, "test-workers")

    def failing() -> None:
        raise ValueError("engine said no")

    async def main() -> None:
        await threads.run(failing)

    try:
        with pytest.raises(ValueError, match="engine said no"):
            anyio.run(main, backend="asyncio")
    finally:
        threads.close()


def test_a_cancelled_caller_waits_for_its_call_to_return() -> None:
    threads = WorkerThreads(1, "test-workers")
    entered, release = threading.Event(), threading.Event()
    finished: list[bool] = []
    seen_on_return: list[list[bool]] = []
    scopes: list[anyio.CancelScope] = []

    def blocking() -> None:
        entered.set()
        release.wait(10)
        finished.append(True)

    async def caller() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await threads.run(blocking)
        seen_on_return.append(list(finished))

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(caller)
            assert await anyio.to_thread.run_sync(entered.wait, 10)
            scopes[0].cancel()
            for _ in range(50):
                await anyio.lowlevel.checkpoint()
            assert not seen_on_return, "the cancelled caller returned before its call ended"
            release.set()

    try:
        anyio.run(main, backend="asyncio")
    finally:
        threads.close()
    assert seen_on_return == [[True]]


def test_close_ends_the_threads_and_refuses_new_calls() -> None:
    threads = WorkerThreads(2, "test-workers")

    async def main() -> None:
        await threads.run(lambda: None)

    anyio.run(main, backend="asyncio")
    running = list(threads._threads)
    threads.close()
    for thread in running:
        thread.join(10)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        anyio.run(main, backend="asyncio")
