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

from pdflow.sim.cells import cell_coverage
from pdflow.sim.coverage import PROTOCOL_MACHINES, missing, summary
from pdflow.sim.invariants import Transition
from pdflow.sim.runner import run_seed

WORLD_SEEDS = 120


@functools.cache
def world_coverage() -> Counter[Transition]:
    reached: Counter[Transition] = Counter()
    for seed in range(WORLD_SEEDS):
        result, world = run_seed(seed, 300, record=False)
        assert result.ok, (seed, result.violations)
        reached.update(world.monitor.coverage)
    return reached


def test_every_protocol_transition_is_reached() -> None:
    reached = world_coverage() + cell_coverage()
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
