"""benchmarks/room_timeline.py still finds every method it marks: a rename in the nodes or the
transport would otherwise leave its timeline silently missing steps (or the script broken).
Run in a subprocess, since the tool wraps the nodes' classes for its whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = [
    "send_chunk called",
    "prefill step SendChunk>",
    "core handle>",
    "output StartTransfer>",
    "transfer job>",
    "plan>",
    "transport write>",
    "engine submit",
    "engine op completed",
    "prefill step TransferCompleted>",
    "send StatusReport>",
    "publish Success",
    "received",
    "decode step received StatusReport>",
    "decode wait returned",
]


@pytest.mark.parametrize(
    ("size_mib", "polled_in", "in_a_worker"), [(1, "polled write>", False), (4, "settle>", True)]
)
def test_the_timeline_marks_every_step_of_one_room(
    tmp_path: Path, size_mib: int, polled_in: str, in_a_worker: bool
) -> None:
    """A 1 MiB room is a small call polled on the loop (no worker thread on its path); a 4 MiB
    one is a worker job handed to a worker thread."""
    out = tmp_path / "timeline.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    subprocess.run(
        [sys.executable, "-m", "benchmarks.room_timeline", "--size-mib", str(size_mib),
         "--rooms", "3", "--json", str(out)],
        cwd=ROOT, env=env, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    timeline = json.loads(out.read_text())
    labels = [step["from"] for step in timeline["steps"]] + [timeline["steps"][-1]["to"]]
    missing = [label for label in [*EXPECTED, polled_in] if label not in labels]
    assert not missing, f"marks never stamped: {missing} (stamped: {labels})"
    if in_a_worker:
        assert "worker thread>" in labels, labels
    # A 1 MiB write still on the wire after the loop's 2 ms of polling goes to a worker thread
    # too (a loaded machine): its absence there is not asserted.
    assert timeline["rooms"] + timeline["left_out"] == 3
    assert timeline["total_median_ms"] > 0
    assert timeline["parts_median_ms"]["wire"] > 0, "no room's wire was split out"
