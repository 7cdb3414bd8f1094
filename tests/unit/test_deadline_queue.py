"""DeadlineQueue keeps its earliest deadline in an attribute: it must always equal the earliest
of the deadlines armed now, however keys are armed, re-armed, disarmed and popped."""

from __future__ import annotations

import random

from pdflow.core.framework.deadlines import DeadlineQueue


def _earliest(armed: dict[int, float]) -> float | None:
    return min(armed.values()) if armed else None


def test_next_deadline_is_the_earliest_armed_one_after_every_operation() -> None:
    rng = random.Random(15)
    for _ in range(40):
        queue: DeadlineQueue[int] = DeadlineQueue()
        armed: dict[int, float] = {}
        now = 0.0
        for _ in range(400):
            key = rng.randrange(12)
            roll = rng.random()
            if roll < 0.45:
                # Few distinct values, so re-arming with the same or the earliest value is common.
                deadline = now + rng.choice((1.0, 2.0, 3.0, 5.0))
                queue.arm(key, deadline)
                armed[key] = deadline
            elif roll < 0.8:
                queue.arm(key, None)
                armed.pop(key, None)
            elif roll < 0.9:
                now += rng.choice((0.5, 1.0, 2.0))
                due = queue.pop_due(now)
                expected = [k for k, d in armed.items() if d <= now]
                assert sorted(due) == sorted(expected)
                for k in due:
                    del armed[k]
            assert queue.next_deadline() == queue.earliest == _earliest(armed)
            assert len(queue) == len(armed)


def test_disarming_the_earliest_key_moves_next_deadline_on() -> None:
    queue: DeadlineQueue[str] = DeadlineQueue()
    queue.arm("a", 1.0)
    queue.arm("b", 2.0)
    assert queue.next_deadline() == 1.0
    queue.arm("a", None)
    assert queue.next_deadline() == 2.0
    queue.arm("b", 4.0)  # re-armed later: the earliest goes with it
    assert queue.next_deadline() == 4.0
    queue.arm("c", 3.0)
    assert queue.next_deadline() == 3.0
    assert queue.pop_due(3.5) == ["c"]
    assert queue.next_deadline() == 4.0
    queue.arm("b", None)
    assert queue.next_deadline() is None
