"""The window faults of the simulated world: each is enabled only while its window is open, and
does what its name says there."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.sim.actions import apply, choices
from pdflow.sim.faults import WINDOW_KINDS, draw_plan
from pdflow.sim.network import Envelope
from pdflow.sim.runner import run_seed
from pdflow.sim.world import World

ENGINE_STEPS = ("local_event", "deliver", "open_decode", "open_prefill", "decode_allocate",
                "prefill_progress", "write_complete", "write_report")  # fmt: skip
"""A fault-free run, one step at a time, in a fixed order."""


def world_with_checksums(seed: int = 15) -> World:
    """A world whose decode verifies checksums the prefill sends, behind a receiver fence."""
    shape = draw_plan(seed).shape
    assert shape.verify_checksums and shape.prefill_checksums and shape.receiver_fence
    world = World(draw_plan(seed))
    apply(world, "new_request", 0, hint=12 << 3)  # 12 tokens: 3 pages, sent in chunks
    return world


def run_until(world: World, opened: Callable[[World], bool], hint: int = 0) -> None:
    for _ in range(500):
        if opened(world):
            return
        kind = next(k for k in ENGINE_STEPS if choices(world, k))
        apply(world, kind, 0, hint)
    raise AssertionError("the window never opened")


def verifying(world: World) -> bool:
    return any(s.state == "VERIFYING" for d in world.decode
               for s in map(d.endpoint.summary, d.endpoint.open_rooms()) if s)  # fmt: skip


def test_no_window_is_open_in_a_world_without_rooms() -> None:
    world = World(draw_plan(15))
    assert all(choices(world, kind) == [] for kind in WINDOW_KINDS)


def test_abort_verifying_is_offered_only_while_the_node_verifies_and_fails_the_room() -> None:
    world = world_with_checksums()
    run_until(world, lambda w: bool(choices(w, "abort_verifying")))
    assert verifying(world)
    rank, room = choices(world, "abort_verifying")[0]
    apply(world, "abort_verifying", 0)
    assert world.decode[rank].endpoint.summary(room).poll is KVPoll.Failed  # type: ignore[union-attr]
    assert choices(world, "abort_verifying") == []
    world.monitor.assert_ok()


def test_stall_mid_write_declares_the_prefill_dead_fences_it_and_it_answers_again() -> None:
    world = world_with_checksums()
    run_until(world, lambda w: bool(choices(w, "stall_mid_write")), hint=0)  # one page a chunk
    transferring = [p.endpoint.summary(r) for p in world.prefill for r in p.endpoint.open_rooms()]
    assert any(s is not None and s.state == "TRANSFERRING" for s in transferring)
    apply(world, "stall_mid_write", 0)
    assert not world.prefill_paused
    assert not [e for e in world.local_events if e.kind == "fence"], "every fence applied"
    for decode in world.decode:
        counters = decode.endpoint.snapshot().counters
        assert counters.get("prefill_instances_lost", 0) >= 1, counters
        rooms = [decode.endpoint.summary(r) for r in decode.endpoint.open_rooms()]
        assert all(s is not None and s.poll is KVPoll.Failed for s in rooms)
    world.monitor.assert_ok()


def test_window_race_offers_a_late_copy_to_a_verifying_room_which_keeps_verifying() -> None:
    world = world_with_checksums()
    run_until(world, verifying)
    windows = choices(world, "window_race")
    late = [w for w in windows if w[0] == "late_copy" and w[1].startswith("decode")]
    assert late, windows
    _, name, room, _, _ = late[0]
    apply(world, "window_race", windows.index(late[0]))
    decode = next(d for d in world.decode if d.name == name)
    assert decode.endpoint.summary(room).state == "VERIFYING"  # type: ignore[union-attr]
    world.monitor.assert_ok()


def test_a_late_copy_never_crosses_a_cut_link() -> None:
    world = world_with_checksums()
    run_until(world, verifying)
    assert [w for w in choices(world, "window_race") if w[0] == "late_copy"]
    for prefill in world.prefill:
        for decode in world.decode:
            world.network.partition(prefill.me.address, decode.me.address)
    assert not [w for w in choices(world, "window_race") if w[0] == "late_copy"]
    world.network.heal()
    assert [w for w in choices(world, "window_race") if w[0] == "late_copy"]


def test_no_message_is_delivered_over_a_cut_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 360 delivered a window race's late copy over a cut link (2 of the deliveries of
    the first 1,000 seeds did)."""
    crossed: list[str] = []
    original = World.deliver

    def deliver(world: World, envelope: Envelope) -> None:
        if not world.network.passes(envelope):
            crossed.append(f"{type(envelope.message).__name__} over {envelope.link}")
        original(world, envelope)

    monkeypatch.setattr(World, "deliver", deliver)
    result, world = run_seed(360, 300, record=False)
    assert result.ok, result.violations
    assert world.plan.weights["partition"] > 0 and world.plan.weights["window_race"] > 0
    assert not crossed, crossed
