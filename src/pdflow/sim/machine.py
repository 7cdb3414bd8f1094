"""A reusable Hypothesis state machine over a simulated World.

Subclass :class:`WorldMachine` to model-check an embedding: every action kind of
:mod:`pdflow.sim.actions` is a rule, enabled by a precondition (never ``assume``), with a drawn
index (which message to deliver: reordering) and a drawn size hint. The drawn seed's plan
decides which kinds exist in a world, as for the seeded driver: a fault outside its profile (or
switched off in it) is never a rule's to take. The protocol invariants run
after every step; ``teardown`` heals the world, lets it settle and checks liveness. Add your own
``@invariant`` methods reading ``self.world``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdflow.sim.actions import apply, choices, settle
from pdflow.sim.faults import ACTION_KINDS, draw_plan
from pdflow.sim.invariants import InvariantViolation, Transition, check_quiescent
from pdflow.sim.world import World

INDEX = st.integers(min_value=0, max_value=1 << 16)
HINT = st.integers(min_value=0, max_value=1 << 24)

COVERAGE: Counter[Transition] = Counter()
"""Every spec transition any WorldMachine run in this process took (for the coverage test)."""


class WorldMachine(RuleBasedStateMachine):
    world: World

    @initialize(seed=st.integers(min_value=0, max_value=(1 << 32) - 1))
    def build_world(self, seed: int) -> None:
        self.world = World(draw_plan(seed))

    def act(self, kind: str, index: int, hint: int) -> None:
        apply(self.world, kind, index, hint)

    def enabled(self, kind: str) -> bool:
        """Whether the rule for ``kind`` may run now: the world's plan has it, and it has a
        choice."""
        if not hasattr(self, "world") or self.world.plan.weights[kind] <= 0:
            return False
        return bool(choices(self.world, kind))

    @invariant()
    def protocol_invariants(self) -> None:
        if hasattr(self, "world"):
            self.world.monitor.assert_ok()

    def teardown(self) -> None:
        if not hasattr(self, "world"):
            return
        COVERAGE.update(self.world.monitor.coverage)
        settle(self.world)
        COVERAGE.update(self.world.monitor.coverage)
        self.world.monitor.assert_ok()
        problems = check_quiescent(self.world)
        if problems:
            raise InvariantViolation("liveness:\n" + "\n".join(problems))


def _enabled(kind: str) -> Any:
    return lambda self: self.enabled(kind)


def _make_rule(kind: str) -> Any:
    def run(self: WorldMachine, index: int, hint: int) -> None:
        self.act(kind, index, hint)

    run.__name__ = kind
    return precondition(_enabled(kind))(rule(index=INDEX, hint=HINT)(run))


for _kind in ACTION_KINDS:
    setattr(WorldMachine, _kind, _make_rule(_kind))
