"""benchmarks/room_timeline.py's split of each room at the wire: before the first engine submit,
first submit to the last op seen completed, after it; and where deferred trace batches fell
(left out of the step order, so a room with one is still counted in the step medians)."""

from __future__ import annotations

from benchmarks.room_timeline import TRACE_WRITE, summarise

Mark = tuple[str, float]


def _room(t0: float, trace_at: tuple[float, ...] = ()) -> list[Mark]:
    ms = 1e-3
    marks = [
        ("send_chunk called", t0),
        ("engine submit", t0 + 0.2 * ms),
        ("engine submit", t0 + 0.3 * ms),
        ("engine op completed", t0 + 2.0 * ms),
        ("engine op completed", t0 + 2.2 * ms),
        ("decode wait returned", t0 + 2.7 * ms),
    ]
    for at in trace_at:
        marks += [(TRACE_WRITE + ">", t0 + at * ms), (TRACE_WRITE + "<", t0 + (at + 0.01) * ms)]
    return sorted(marks, key=lambda mark: mark[1])


def test_each_room_is_split_at_its_first_submit_and_its_last_completion() -> None:
    timeline = summarise([_room(0.0), _room(1.0), _room(2.0)])
    parts = timeline["parts_median_ms"]
    assert abs(parts["before"] - 0.2) < 1e-9
    assert abs(parts["wire"] - 2.0) < 1e-9
    assert abs(parts["after"] - 0.5) < 1e-9


def test_trace_writes_are_counted_per_part_and_do_not_drop_the_room() -> None:
    rooms = [_room(0.0, (0.1,)), _room(1.0, (1.0,)), _room(2.0, (2.5,)), _room(3.0)]
    timeline = summarise(rooms)
    assert timeline["rooms"] == 4 and timeline["left_out"] == 0
    assert timeline["rooms_with_trace_writes"] == {"before": 1, "wire": 1, "after": 1}
    labels = [row["from"] for row in timeline["steps"]]
    assert TRACE_WRITE + ">" not in labels
