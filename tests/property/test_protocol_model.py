"""Model checking of the whole protocol with Hypothesis.

Hypothesis explores interleavings of messages (delivery in any order, loss, duplication,
partitions), transport outcomes (slow, failed, corrupted, landing late), timers, aborts from
either side, crashes and heartbeat failures over a simulated world of small topologies drawn
from a seed. The invariants of :mod:`pdflow.sim.invariants` are checked after every step and
liveness in teardown. ``PDFLOW_EXAMPLES`` raises the budget.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from pdflow.sim.invariants import INVARIANTS
from pdflow.sim.machine import WorldMachine

pytestmark = pytest.mark.invariant(*INVARIANTS)

EXAMPLES = int(os.environ.get("PDFLOW_EXAMPLES", "150"))


class ProtocolModel(WorldMachine):
    """The shipped WorldMachine, as is: every rule, every invariant."""


ProtocolModel.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestProtocolModel = ProtocolModel.TestCase
