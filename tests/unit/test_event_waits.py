"""EventHub.wait_status: which status wakes a waiter, several waiters on one room, and a
cancelled waiter leaving nothing behind (a wait is what each waiting room keeps alive)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import EventHub, RoomStatus


def _run(story: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        with anyio.fail_after(5):  # a waiter left asleep fails the test instead of hanging it
            await story()

    anyio.run(bounded, backend="asyncio")


_OPEN = {"is_open": True, "open_call": "open"}


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
            got.append(await hub.wait_status(0, 7, at_least, **_OPEN))

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
        assert await hub.wait_status(0, 7, KVPoll.WaitingForInput, **_OPEN) == ready
        got: list[RoomStatus] = []

        async def waiter() -> None:
            got.append(await hub.wait_status(0, 7, KVPoll.Success, **_OPEN))

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
            got.append(await hub.wait_status(0, 7, KVPoll.Success, **_OPEN))

        async with anyio.create_task_group() as outer:
            outer.start_soon(waiter)
            with anyio.move_on_after(0.01):  # this one gives up on room 7 ...
                await hub.wait_status(0, 7, KVPoll.Success, **_OPEN)
            with anyio.move_on_after(0.01):  # ... and this one on room 9, which never changes
                await hub.wait_status(0, 9, KVPoll.Success, **_OPEN)
            assert hub.waiting_rooms() == 1, "a cancelled wait must not stay registered"
            hub.publish(_status(KVPoll.Success))
        assert got == [_status(KVPoll.Success)]
        assert hub.waiting_rooms() == 0

    _run(story)


def test_a_wait_on_a_room_that_is_not_open_and_has_no_status_is_refused() -> None:
    """No status would ever come: the caller learns it at once instead of waiting for good. A
    room that closed after its last status still answers with it until it is reopened."""

    async def story() -> None:
        hub = EventHub()
        with pytest.raises(LocalProtocolError, match="room 7 is not open on rank 0") as refused:
            await hub.wait_status(0, 7, KVPoll.Success, is_open=False, open_call="Rank.open")
        assert "Rank.open" in refused.value.hint and hub.waiting_rooms() == 0
        hub.publish(_status(KVPoll.Failed))
        assert (await hub.wait_status(0, 7, KVPoll.Success, is_open=False,
                                      open_call="Rank.open")).poll is KVPoll.Failed  # fmt: skip

    _run(story)
