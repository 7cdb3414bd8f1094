"""The chaos decode engine's page pool: waiters, the reuse quarantine, painting on release."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import anyio
import pytest

from pdflow.chaos.decode_agent import FREE_ON_HOLD, RankPages, follow_releases, take_all
from pdflow.chaos.kv_pattern import broken_canaries, fill, rank_caches
from pdflow.io.node_common import NodeEvent, PagesHeld, PagesReleased


def pool(pages: int, reuse_after_s: float = 0.0) -> RankPages:
    (cache, kv), = rank_caches(1, pages)
    return RankPages(cache, kv, random.Random(1), reuse_after_s=reuse_after_s)


def emitted(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


def test_two_rooms_waiting_for_pages_of_one_rank_are_both_served() -> None:
    """8 pages all taken; rooms A and B wait for 2 each; all 8 come back: both are served (a
    waiter replacing the other's event would leave A waiting for good)."""
    rank = pool(8)
    held = rank.take(8)
    assert held is not None
    served: dict[str, list[int]] = {}

    async def room(name: str) -> None:
        served[name] = (await take_all([rank], [0], 2))[0]

    async def main() -> None:
        with anyio.fail_after(2):
            async with anyio.create_task_group() as rooms:
                rooms.start_soon(room, "A")
                await anyio.sleep(0.01)
                rooms.start_soon(room, "B")
                await anyio.sleep(0.01)
                rank.release(tuple(held), room=1, generation=0)

    anyio.run(main)
    assert sorted(served) == ["A", "B"]
    assert not set(served["A"]) & set(served["B"])


def test_a_released_page_is_not_taken_again_until_its_quarantine_ends_and_is_checked_then(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rank = pool(4, reuse_after_s=0.3)
    held = rank.take(4)
    assert held is not None
    rank.release((held[0],), room=7, generation=2)
    assert rank.take(1) is None  # free, but still in quarantine
    fill(rank.cache, rank.kv, room=7, generation=2, pages=[held[0]])  # a late write lands

    async def main() -> dict[int, list[int]]:
        with anyio.fail_after(2):
            return await take_all([rank], [0], 1)  # no release comes: the quarantine ends

    started = time.monotonic()
    assert anyio.run(main) == {0: [held[0]]}
    assert time.monotonic() - started >= 0.25
    (found,) = [e for e in emitted(capsys) if e["event"] == "canary"]
    assert found["page"] == held[0] and found["when"] == "taken"
    assert (found["released_room"], found["released_generation"]) == (7, 2)


class FakeNode:
    def __init__(self) -> None:
        self.watchers: list[Any] = []

    def watch(self, watcher: Any) -> None:
        self.watchers.append(watcher)

    def publish(self, event: NodeEvent) -> None:
        for watcher in self.watchers:
            watcher(event)


def test_released_pages_are_freed_and_painted_in_the_step_that_publishes_the_release() -> None:
    """No reader task in between: a write landing right after the release breaks the canary
    instead of being painted over."""
    rank = pool(4)
    taken = rank.take(2)
    assert taken is not None
    fill(rank.cache, rank.kv, room=3, generation=0, pages=taken)
    node = FakeNode()
    follow_releases(node, [rank], {0: 0}, mutant="")  # type: ignore[arg-type]
    node.publish(PagesHeld(rank=0, room=3, generation=0, pages=tuple(taken), waiting_on=()))
    assert rank.in_use == set(taken)  # held pages stay the room's (unless the mutant)
    node.publish(PagesReleased(rank=0, room=3, generation=0, pages=tuple(taken)))
    assert set(taken) <= rank.free and broken_canaries(rank.cache, rank.kv, taken) == []
    fill(rank.cache, rank.kv, room=3, generation=0, pages=taken[:1])
    assert broken_canaries(rank.cache, rank.kv, taken) == taken[:1]


def test_the_free_on_hold_mutant_frees_pages_when_they_are_held() -> None:
    rank = pool(4)
    taken = rank.take(2)
    assert taken is not None
    node = FakeNode()
    follow_releases(node, [rank], {0: 0}, mutant=FREE_ON_HOLD)  # type: ignore[arg-type]
    node.publish(PagesHeld(rank=0, room=3, generation=0, pages=tuple(taken), waiting_on=()))
    assert set(taken) <= rank.free
    node.publish(PagesReleased(rank=0, room=3, generation=0, pages=tuple(taken)))
    assert set(taken) <= rank.free  # the release after it is not a second release
