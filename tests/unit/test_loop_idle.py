"""pdflow.loop_idle: kept work runs at the loop's next declared idle point, or after its delay."""

from __future__ import annotations

import asyncio

from pdflow import loop_idle


def test_work_waits_for_the_delay_without_an_idle_point() -> None:
    async def main() -> list[str]:
        done: list[str] = []
        loop_idle.defer(lambda: done.append("work"), 0.05)
        for _ in range(20):  # many passes of the loop, none an idle point
            await asyncio.sleep(0)
        assert done == []
        await asyncio.sleep(0.1)
        return done

    assert asyncio.run(main()) == ["work"]


def test_an_idle_point_runs_the_kept_work_after_what_is_ready_and_only_once() -> None:
    async def main() -> list[str]:
        order: list[str] = []
        woken = asyncio.Event()

        async def waiter() -> None:
            await woken.wait()
            order.append("waiter")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        loop_idle.defer(lambda: order.append("first"), 0.01)
        loop_idle.defer(lambda: order.append("second"), 0.01)
        woken.set()  # the waiter is ready before the idle point is declared
        loop_idle.idle_point()
        loop_idle.idle_point()  # a second declaration schedules nothing more
        await task
        await asyncio.sleep(0)
        assert order == ["waiter", "first", "second"]
        await asyncio.sleep(0.05)  # the batch's timer finds it done
        return order

    assert asyncio.run(main()) == ["waiter", "first", "second"]


def test_a_later_batch_keeps_its_own_delay_and_an_idle_point_with_nothing_kept_is_a_no_op() -> None:
    async def main() -> list[str]:
        done: list[str] = []
        loop_idle.idle_point()
        loop_idle.defer(lambda: done.append("a"), 0.04)
        loop_idle.idle_point()
        await asyncio.sleep(0.02)
        assert done == ["a"]
        loop_idle.defer(lambda: done.append("b"), 0.04)  # due 0.06 from the start
        await asyncio.sleep(0.03)  # a's own timer (0.04) has fired: it must not run b
        assert done == ["a"]
        await asyncio.sleep(0.03)
        return done

    assert asyncio.run(main()) == ["a", "b"]


def test_one_failing_work_leaves_the_rest_of_its_batch() -> None:
    async def main() -> tuple[list[str], list[object]]:
        done: list[str] = []
        errors: list[object] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(context["exception"])
        )

        def fail() -> None:
            raise OSError("disk full")

        loop_idle.defer(fail)
        loop_idle.defer(lambda: done.append("after"))
        loop_idle.idle_point()
        await asyncio.sleep(0)
        return done, errors

    done, errors = asyncio.run(main())
    assert done == ["after"]
    assert [type(error) for error in errors] == [OSError]


def test_outside_a_loop_work_runs_at_once() -> None:
    done: list[str] = []
    loop_idle.defer(lambda: done.append("now"))
    loop_idle.idle_point()
    assert done == ["now"]


def test_each_loop_keeps_its_own_work() -> None:
    done: list[str] = []

    async def keep() -> None:
        loop_idle.defer(lambda: done.append("kept"), 60.0)

    async def declare() -> None:
        loop_idle.idle_point()
        await asyncio.sleep(0)

    asyncio.run(keep())  # that loop closed with its work kept: never run by another loop
    asyncio.run(declare())
    assert done == []
