"""The model checker catches every mutant: broken cores modelled on real bug classes."""

from __future__ import annotations

import pytest

from pdflow.core.rooms.receiver_room import ReceiverRoom
from pdflow.sim.mutants import MUTANTS, Mutant, applied
from pdflow.sim.runner import run_seed

SEEDS = 200
STEPS = 300


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_caught(mutant: Mutant) -> None:
    actions = 0
    with applied(mutant):
        for seed in range(mutant.first_seed, mutant.first_seed + SEEDS):
            result, _ = run_seed(seed, STEPS, record=False)
            actions += result.actions
            assert result.simulator_error is None, result.simulator_error
            if not result.ok:
                print(
                    f"{mutant.name}: caught at seed {seed} after {actions} actions: "
                    f"{result.violations[0]}"
                )
                return
    pytest.fail(f"mutant {mutant.name} ({mutant.bug_class}) escaped {SEEDS} seeds")


def test_at_least_twelve_mutants_with_distinct_names() -> None:
    assert len(MUTANTS) >= 12
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


def test_applied_restores_the_core() -> None:
    inherited = "fire" not in ReceiverRoom.__dict__
    original_guard = ReceiverRoom.__dict__["_guard_checksum_ok"]
    for mutant in MUTANTS:
        with applied(mutant):
            pass
    assert ReceiverRoom.__dict__["_guard_checksum_ok"] is original_guard
    assert ("fire" not in ReceiverRoom.__dict__) is inherited
    for seed in range(3):
        assert run_seed(seed, 150, record=False)[0].ok
