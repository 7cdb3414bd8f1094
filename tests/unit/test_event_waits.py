"""EventHub.wait_status: which status wakes a waiter, several waiters on one room, and a
cancelled waiter leaving nothing behind (a wait is what each waiting room keeps alive)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import EventHub, RoomStatus


def _run(story: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        with anyio.fail_after(5):  # a waiter left asleep fails the test instead of hanging it
            await story()

    anyio.run(bounded, backend="asyncio")


def _status(poll: KVPoll, room: int = 7) -> RoomStatus:
    return RoomStatus(0, room, 0, poll)


@pytest.mark.parametrize(
    ("published", "at_least", "woken"),
    [
        ([KVPoll.Bootstrapping, KVPoll.WaitingForInput], KVPoll.WaitingForInput, 1),
        ([KVPoll.Bootstrapping, KVPoll.Transferring, KVPoll.Success], KVPoll.Success, 2),
        ([KVPoll.Bootstrapping, KVPoll.Failed], KVPoll.Success, 1),
    ],
)
def test_a_waiter_wakes_on_the_first_status_at_its_threshold_or_failed(
    published: list[KVPoll], at_least: KVPoll, woken: int
) -> None:
    async def story() -> None:
        hub = EventHub()
        got: list[RoomStatus] = []

        async def waiter() -> None:
            got.append(await hub.wait_status(0, 7, at_least))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            for poll in published:
                hub.publish(_status(poll))
                await anyio.wait_all_tasks_blocked()
        assert got == [_status(published[woken])]

    _run(story)


def test_the_current_status_answers_at_once_and_every_waiter_of_a_room_wakes() -> None:
    async def story() -> None:
        hub = EventHub()
        ready = _status(KVPoll.WaitingForInput)
        hub.publish(ready)
        assert await hub.wait_status(0, 7, KVPoll.WaitingForInput) == ready
        got: list[RoomStatus] = []

        async def waiter() -> None:
            got.append(await hub.wait_status(0, 7, KVPoll.Success))

        async with anyio.create_task_group() as tasks:
            for _ in range(3):
                tasks.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            hub.publish(_status(KVPoll.Success, room=8))  # another room wakes nobody here
            await anyio.wait_all_tasks_blocked()
            assert got == []
            hub.publish(_status(KVPoll.Success))
        assert got == [_status(KVPoll.Success)] * 3

    _run(story)


def test_a_cancelled_waiter_leaves_nothing_and_the_others_still_wake() -> None:
    async def story() -> None:
        hub = EventHub()
        got: list[RoomStatus] = []

        async def waiter() -> None:
            got.append(await hub.wait_status(0, 7, KVPoll.Success))

        async with anyio.create_task_group() as outer:
            outer.start_soon(waiter)
            with anyio.move_on_after(0.01):  # this one gives up on room 7 ...
                await hub.wait_status(0, 7, KVPoll.Success)
            with anyio.move_on_after(0.01):  # ... and this one on room 9, which never changes
                await hub.wait_status(0, 9, KVPoll.Success)
            assert hub.waiting_rooms() == 1, "a cancelled wait must not stay registered"
            hub.publish(_status(KVPoll.Success))
        assert got == [_status(KVPoll.Success)]
        assert hub.waiting_rooms() == 0

    _run(story)
