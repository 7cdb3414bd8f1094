"""The endpoint lock: one step at a time per endpoint, its outputs carried out before the next
step begins, and a free lock taken without a trip through the event loop."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel

from pdflow.core.endpoints.endpoint_io import TimerFired
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.outputs import Output, StatusChanged
from pdflow.io.metrics import NodeMetrics
from pdflow.io.node_common import EndpointHost, EventHub

PREFILL = PeerId("127.0.0.1:7000", "p1", 0)


class Recording:
    """An endpoint whose every step has one output, and a log of what ran when."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.steps = 0

    def handle(self, inp: Any, now: float) -> Step:
        self.steps += 1
        self.log.append(f"handle {self.steps}")
        return Step(outputs=(StatusChanged(self.steps, 0, KVPoll.Transferring, ""),))


def host(endpoint: Recording, yields: int) -> EndpointHost:
    async def carry_out(output: Output, msg_id: str | None) -> None:
        assert isinstance(output, StatusChanged)
        endpoint.log.append(f"carry out {output.room}")
        for _ in range(yields):  # an effect that awaits (a send waiting for room, a fence)
            await anyio.lowlevel.checkpoint()
        endpoint.log.append(f"done {output.room}")

    return EndpointHost("p#0", endpoint, 0, PREFILL, lambda _: carry_out,
                        NodeMetrics("prefill", "n"), EventHub())  # fmt: skip


def test_steps_of_concurrent_tasks_never_interleave() -> None:
    """Each step's outputs are carried out before another task's step is handled, although
    the effects await: fails with the lock taken out of EndpointHost._drive."""

    async def story() -> list[str]:
        endpoint = Recording()
        h = host(endpoint, yields=3)
        async with anyio.create_task_group() as tasks:
            for _ in range(4):
                tasks.start_soon(h.feed, TimerFired())
        return endpoint.log

    log = anyio.run(story)
    assert log == [line for n in range(1, 5)
                   for line in (f"handle {n}", f"carry out {n}", f"done {n}")]  # fmt: skip


def test_a_free_lock_costs_no_trip_through_the_event_loop() -> None:
    """A step on a free endpoint runs straight through when its effects do not await: another
    task gets no turn between 200 such steps. The loops that feed steps in bursts yield
    themselves (tests/unit/test_control_channel.py). Fails with a lock that checkpoints when
    free, as anyio's Lock does without fast_acquire (the other task then gets a turn every
    step)."""

    async def story() -> int:
        endpoint = Recording()
        h = host(endpoint, yields=0)
        turns = 0
        stop = False

        async def other() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other)
            await anyio.lowlevel.checkpoint()  # let it start
            before = turns
            for _ in range(200):
                await h.feed(TimerFired())
            during = turns - before
            stop = True
        assert endpoint.steps == 200
        return during

    assert anyio.run(story) == 0
