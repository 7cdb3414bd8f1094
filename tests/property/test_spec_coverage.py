"""Spec coverage: every transition of the protocol machines is reached by some run in CI.

The simulated worlds (seeded runs within the CI budget) reach most rows. Rows a world cannot
reach through its endpoints are reached by targeted drives below and counted too: guard-false
``Tick`` rows and late inputs in terminal states (an endpoint only ticks a room whose deadline
is due, and engines clear terminal rooms), by driving each room state with each input as the
room-cell fixtures do; ``ReleaseUnpublished`` (the decode endpoint frees unpublished pages
itself) and a writer declared dead after its session was closed, by driving the ledger.
"""

from __future__ import annotations

import functools
from collections import Counter

from pdflow.core.errors import ProtocolError
from pdflow.core.inputs import AbortRequested, Input, TransferCompleted
from pdflow.core.messages import PeerId
from pdflow.core.page_ledger import (
    Fence,
    PageLedger,
    ReleaseUnpublished,
    Reserve,
    SessionClosed,
    WriterDead,
)
from pdflow.core.receiver_room import ReceiverState
from pdflow.core.sender_room import SenderState
from pdflow.core.table import Fired
from pdflow.sim.coverage import missing, summary
from pdflow.sim.invariants import Transition
from pdflow.sim.runner import run_seed
from tests.unit.room_fixtures import receiver_in, receiver_samples, sender_in, sender_samples

PROTOCOL_MACHINES = ("SenderRoom", "ReceiverRoom", "PageLedger")
WORLD_SEEDS = 120


def _add(counter: Counter[Transition], fired: Fired | tuple[Fired, ...]) -> None:
    for f in fired if isinstance(fired, tuple) else (fired,):
        counter[(f.machine, f.source, f.on, f.guard, f.target)] += 1


@functools.cache
def world_coverage() -> Counter[Transition]:
    reached: Counter[Transition] = Counter()
    for seed in range(WORLD_SEEDS):
        result, world = run_seed(seed, 300, record=False)
        assert result.ok, (seed, result.violations)
        reached.update(world.monitor.coverage)
    return reached


def targeted_room_coverage() -> Counter[Transition]:
    reached: Counter[Transition] = Counter()
    drives = [
        (sender_in, sender_samples, SenderState),
        (receiver_in, receiver_samples, ReceiverState),
    ]
    for build, samples, states in drives:
        for state in states:
            for steps in samples(build(state)).values():
                room = build(state)
                try:
                    for inp in steps:
                        _, fired = room.fire(inp, 2.0)
                        _add(reached, fired)
                except ProtocolError:
                    continue  # no such cell: test_room_cells checks the refusal
    # An engine abort between chunks, with every write so far completed.
    sender = sender_in(SenderState.TRANSFERRING)
    for seq in sorted(sender.outstanding):
        _add(reached, sender.fire(TransferCompleted(seq, True), 2.0)[1])
    _add(reached, sender.fire(AbortRequested("engine gave up"), 2.0)[1])
    return reached


def targeted_ledger_coverage() -> Counter[Transition]:
    reached: Counter[Transition] = Counter()
    writer = PeerId("10.0.0.1:7000", "inc", 0)
    ledger = PageLedger(4)
    steps: list[Input] = [Reserve(1, 1, (0,)), ReleaseUnpublished(1, 1)]
    steps += [
        Reserve(2, 1, (1,)),
        Fence(2, 1, (writer,)),
        SessionClosed(writer),
        WriterDead(writer),
    ]
    for inp in steps:
        _add(reached, ledger.handle(inp, 1.0).fired)  # type: ignore[arg-type]
    return reached


def test_every_protocol_transition_is_reached() -> None:
    reached = world_coverage() + targeted_room_coverage() + targeted_ledger_coverage()
    unreached = missing(reached, PROTOCOL_MACHINES)
    assert not unreached, f"{len(unreached)} spec transitions never reached:\n" + "\n".join(
        unreached
    )
    print(summary(reached, PROTOCOL_MACHINES))


def test_worlds_alone_reach_most_of_the_protocol() -> None:
    """The simulation itself (not the targeted drives) must keep reaching the bulk of the spec:
    a regression here means the worlds stopped exploring part of the protocol."""
    reached = world_coverage()
    unreached = missing(reached, PROTOCOL_MACHINES)
    assert len(unreached) <= 45, "\n".join(unreached)
