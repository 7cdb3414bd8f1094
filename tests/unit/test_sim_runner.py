"""The seeded runner tells a core that raised (no_core_error) from a simulator that raised (a bug
of pdflow.sim, reported with its traceback), and a world that never settles from either."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import pdflow.sim.runner as runner
from pdflow.cli import main
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.resources.admission import AdmissionQueue
from pdflow.sim.actions import settle
from pdflow.sim.invariants import INVARIANTS
from pdflow.sim.runner import run_seed
from pdflow.sim.world import World


def _deliver_into_a_simulator_bug(world: World, envelope: Any) -> None:
    raise KeyError("the simulator lost track of a process")


def _core_refuses_everything(endpoint: Any, inp: Any, now: float) -> Any:
    raise RuntimeError("the core tripped over its own state")


def test_an_exception_of_the_simulator_is_a_simulator_bug_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(World, "deliver", _deliver_into_a_simulator_bug)
    result, _ = run_seed(0, 300, record=False)
    assert not result.ok
    assert not any("no_core_error" in v for v in result.violations), result.violations
    assert result.simulator_error is not None
    assert "Traceback" in result.simulator_error
    assert "_deliver_into_a_simulator_bug" in result.simulator_error
    assert result.first_problem.startswith("simulator bug: KeyError")


@pytest.mark.invariant("no_core_error")
@pytest.mark.parametrize(
    ("owner", "method"), [(PrefillEndpoint, "handle"), (AdmissionQueue, "handle")]
)
def test_an_exception_out_of_a_core_machine_is_no_core_error(
    monkeypatch: pytest.MonkeyPatch, owner: type, method: str
) -> None:
    monkeypatch.setattr(owner, method, _core_refuses_everything)
    for seed in range(5):
        result, _ = run_seed(seed, 300, record=False)
        if result.violations:
            break
    assert result.simulator_error is None, result.simulator_error
    assert "[no_core_error] RuntimeError: the core tripped" in result.violations[0]


@pytest.mark.invariant("rooms_settle")
def test_a_world_that_never_settles_breaks_rooms_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "settle", functools.partial(settle, max_rounds=0))
    result, _ = run_seed(0, 300, record=False)
    assert result.simulator_error is None
    assert result.violations == [
        "liveness: [rooms_settle] the world did not settle within 0 rounds"
    ]


def test_pdflow_check_shows_a_simulator_bug_as_such(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    monkeypatch.setattr(World, "deliver", _deliver_into_a_simulator_bug)
    assert main(["check", "--examples", "1", "--steps", "300", "--trace-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "a bug of the simulator (pdflow.sim), not a protocol finding" in out
    assert "KeyError: 'the simulator lost track of a process'" in out
    assert "no_core_error" not in out


def test_a_mutant_under_which_the_simulator_raises_is_not_counted_caught(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pdflow.sim.mutants as mutants

    breaks_the_world = mutants.Mutant(
        "breaks_the_world", "none", "the simulator raises",
        ((World, "deliver", lambda original: _deliver_into_a_simulator_bug),),
    )  # fmt: skip
    monkeypatch.setattr(mutants, "MUTANTS", (breaks_the_world,))
    assert main(["check", "--mutants", "--examples", "3", "--steps", "300"]) == 1
    out = capsys.readouterr().out
    assert "SIMBUG  breaks_the_world: the simulator itself raised at seed" in out
    assert "0/1 mutants caught" in out and "ESCAPED" not in out


def test_the_invariant_check_count_is_what_really_ran() -> None:
    """It was every invariant id once per core step, plus every id once more: a world where
    nothing but settling happened claimed 31 checks."""
    idle, idle_world = run_seed(0, 0, record=False)
    assert idle.core_steps == 0
    registrations = idle_world.shape.prefill_ranks  # the registry's answers: core steps too
    assert idle.checked == {"no_core_error": registrations, "registry_ordered": registrations,
                            "rooms_settle": 1, "pages_return": 1,
                            "verdict_revisable": 1}  # fmt: skip
    assert idle.invariant_checks == 2 * registrations + 3

    result, world = run_seed(0, 300, record=False)
    assert result.ok and result.core_steps > 100
    assert result.invariant_checks == sum(result.checked.values())
    assert result.invariant_checks < len(INVARIANTS) * result.core_steps
    decode_successes = [key for key, poll in world.monitor.outcomes.items()
                        if key[0].startswith("decode") and poll is KVPoll.Success]  # fmt: skip
    assert result.checked["success_needs_all_peers"] == len(decode_successes) > 0
    assert result.checked["no_use_after_free"] == world.transport.pages_checked > 0
