"""The seeded driver behind ``pdflow check``: one seed, one world, one reproducible run.

The seed draws the FaultPlan (the world's shape and how often each action is picked) and
drives every choice with its own ``random.Random``: the same seed replays the same run, byte
for byte. A failure keeps the trace (TraceHeader + StepRecords) for ``pdflow trace`` tools.
"""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter
from pathlib import Path

import msgspec

from pdflow.sim.actions import WorldDidNotSettle, apply, choices, settle
from pdflow.sim.faults import ACTION_KINDS, draw_plan
from pdflow.sim.invariants import Transition, check_quiescent
from pdflow.sim.world import World


class RunResult(msgspec.Struct):
    seed: int
    actions: int
    core_steps: int
    invariant_checks: int
    violations: list[str]
    elapsed_s: float
    trace_path: str | None = None
    coverage: dict[str, int] = msgspec.field(default_factory=dict)
    checked: dict[str, int] = msgspec.field(default_factory=dict)
    """How many times each invariant was evaluated (they sum to ``invariant_checks``)."""
    simulator_error: str | None = None
    """The traceback of an exception the simulator itself raised (not a core machine): a bug
    of pdflow.sim, which ends the run without saying anything about the protocol."""

    @property
    def ok(self) -> bool:
        return not self.violations and self.simulator_error is None

    @property
    def first_problem(self) -> str:
        """The first violation, else the simulator bug's last line; empty when ok."""
        if self.violations:
            return self.violations[0]
        if self.simulator_error is not None:
            return f"simulator bug: {self.simulator_error.strip().splitlines()[-1]}"
        return ""


def run_seed(
    seed: int,
    steps: int,
    *,
    record: bool = True,
    trace_dir: Path | None = None,
    mutant: str | None = None,
) -> tuple[RunResult, World]:
    """Run one world for ``steps`` actions, then settle it and check liveness. ``mutant``
    names the mutant core the caller applied, for the trace's headers."""
    started = time.perf_counter()
    plan = draw_plan(seed)
    world = World(plan, record=record, mutant=mutant)
    driver = random.Random(seed * 2 + 1)
    kinds = [k for k in ACTION_KINDS if plan.weights[k] > 0]
    simulator_error = None
    try:
        for _ in range(steps):
            enabled = [(k, n) for k in kinds if (n := len(choices(world, k)))]
            weights = [plan.weights[k] for k, _ in enabled]
            kind, count = driver.choices(enabled, weights)[0]
            apply(world, kind, driver.randrange(count), driver.getrandbits(24))
            if world.monitor.violations:
                break
        if not world.monitor.violations:
            settle(world)
            world.monitor.violations.extend(
                f"liveness: {problem}" for problem in check_quiescent(world)
            )
    except WorldDidNotSettle as exc:
        world.monitor.violations.append(f"liveness: [rooms_settle] {exc}")
    except Exception as exc:
        if world.raised_by_core(exc):  # a core that raises is a finding too: keep its trace
            world.monitor.fail("no_core_error", f"{type(exc).__name__}: {exc}")
        else:
            simulator_error = traceback.format_exc()
    result = RunResult(
        seed=seed,
        actions=world.actions,
        core_steps=world.steps,
        invariant_checks=world.monitor.checks,
        checked=dict(world.monitor.counts),
        violations=list(world.monitor.violations),
        elapsed_s=time.perf_counter() - started,
        simulator_error=simulator_error,
    )
    if not result.ok and world.trace is not None and trace_dir is not None:
        result.trace_path = str(world.trace.write(trace_dir / f"pdflow-check-{seed}.jsonl"))
    return result, world


def merged_coverage(worlds_coverage: list[Counter[Transition]]) -> Counter[Transition]:
    total: Counter[Transition] = Counter()
    for counter in worlds_coverage:
        total.update(counter)
    return total
