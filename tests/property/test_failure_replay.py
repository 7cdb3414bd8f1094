"""A model-checking failure's trace replays to the same invariant violation, offline.

The checker finds a broken core (a mutant modelled on SGLang's `max()` status update, which let
a late Success lift a Failed room), writes the trace, and `pdflow replay` re-runs it: with the
same core the replay is identical and the same room is seen going Failed -> Success; with the
correct core the replay diverges at exactly the step where the bug acted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pdflow.sim.mutants import applied, by_name
from pdflow.sim.runner import run_seed
from pdflow.trace.merge import load_traces
from pdflow.trace.replay import replay

VIOLATION = re.compile(r"room (\d+)/(\d+) went Failed -> Success")


def _first_failure(tmp_path: Path) -> tuple[Path, tuple[int, int]]:
    for seed in range(200):
        result, world = run_seed(seed, 300)
        found = next((VIOLATION.search(v) for v in result.violations if VIOLATION.search(v)), None)
        if found is not None and world.trace is not None:
            path = world.trace.write(tmp_path / f"failure-{seed}.jsonl")
            return path, (int(found.group(1)), int(found.group(2)))
    raise AssertionError("the mutant was never caught in 200 seeds")


def test_a_failure_trace_replays_to_the_same_violation(tmp_path: Path) -> None:
    with applied(by_name("max_status_lifts_failed")):
        path, (room, generation) = _first_failure(tmp_path)
        last_poll: dict[tuple[str, int], str] = {}
        lifted: list[tuple[str, int, int]] = []

        def watch(record: Any, endpoints: Any) -> None:
            for entry in record.rooms:
                summary = entry.get("summary")
                if not summary:
                    continue
                key = (record.endpoint, entry["room"])
                poll = summary["poll"] if isinstance(summary["poll"], str) else str(summary["poll"])
                if last_poll.get(key) in ("0", "Failed") and poll not in ("0", "Failed"):
                    lifted.append((record.endpoint, entry["room"], summary["generation"]))
                last_poll[key] = poll

        same_core = replay(load_traces([path]), on_step=watch)
        assert same_core.divergence is None, "the failing run replays identically"
        assert any(r == room and g == generation for _, r, g in lifted), lifted
    fixed_core = replay(load_traces([path]))
    assert fixed_core.divergence is not None, "the correct core disagrees with the buggy trace"
