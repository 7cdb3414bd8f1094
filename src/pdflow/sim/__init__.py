"""pdflow.sim: deterministic simulation and model checking of the PD protocol.

Build a :class:`World` from a seed's :class:`FaultPlan`, drive it with actions (or with the
Hypothesis :class:`~pdflow.sim.machine.WorldMachine`, or :func:`run_seed`), and every endpoint
step is checked against the protocol's invariants and recorded in a replayable trace.
"""

from pdflow.sim.actions import apply, choices, settle
from pdflow.sim.faults import ACTION_KINDS, FaultPlan, WorldShape, draw_plan
from pdflow.sim.invariants import INVARIANTS, InvariantViolation, Monitor, check_quiescent
from pdflow.sim.mutants import MUTANTS, Mutant, applied
from pdflow.sim.runner import RunResult, run_seed
from pdflow.sim.world import World

__all__ = [
    "ACTION_KINDS",
    "INVARIANTS",
    "MUTANTS",
    "FaultPlan",
    "InvariantViolation",
    "Monitor",
    "Mutant",
    "RunResult",
    "World",
    "WorldShape",
    "applied",
    "apply",
    "check_quiescent",
    "choices",
    "draw_plan",
    "run_seed",
    "settle",
]
