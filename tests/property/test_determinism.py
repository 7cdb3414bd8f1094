"""Determinism: one seed, one run, byte for byte (madsim's check_determinism, in Python)."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from pdflow.sim.faults import draw_plan
from pdflow.sim.runner import run_seed
from pdflow.trace.format import StepRecord, TraceHeader


@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_same_seed_gives_byte_identical_traces(seed: int) -> None:
    first, world_a = run_seed(seed, 250)
    second, world_b = run_seed(seed, 250)
    assert world_a.trace is not None and world_b.trace is not None
    assert world_a.trace.to_bytes() == world_b.trace.to_bytes()
    assert first.core_steps == second.core_steps > 0


def test_different_seeds_give_different_runs() -> None:
    _, world_a = run_seed(1, 150)
    _, world_b = run_seed(2, 150)
    assert world_a.trace is not None and world_b.trace is not None
    assert world_a.trace.to_bytes() != world_b.trace.to_bytes()


def test_trace_starts_with_the_seed_and_fault_plan_and_decodes() -> None:
    _, world = run_seed(3, 100)
    assert world.trace is not None
    decoder = msgspec.json.Decoder(TraceHeader | StepRecord)
    lines = [decoder.decode(line) for line in world.trace.lines]
    first = lines[0]
    assert isinstance(first, TraceHeader)
    assert first.seed == 3 and first.clock == "virtual"
    assert first.fault_plan == draw_plan(3).to_builtins()
    steps = [line for line in lines if isinstance(line, StepRecord)]
    first_seqs = {s.endpoint: s.seq for s in reversed(steps)}
    assert set(first_seqs.values()) == {0}
    assert all(b.t >= a.t for a, b in itertools.pairwise(steps))


@pytest.mark.parametrize("seed", [4, 9])
def test_simulated_traces_replay_identically(seed: int, tmp_path: Path) -> None:
    """A simulated world's trace is a real pdflow trace: `pdflow replay` re-runs every endpoint
    from its inputs and finds the same outputs, transitions and rooms."""
    from pdflow.cli import main

    _, world = run_seed(seed, 250)
    assert world.trace is not None
    path = world.trace.write(tmp_path / "world.jsonl")
    assert main(["replay", str(path)]) == 0
