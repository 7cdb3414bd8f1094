"""The simulated world: plans from seeds, a clean transfer end to end, the invariants biting."""

from __future__ import annotations

import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.sim.actions import apply, choices, settle
from pdflow.sim.clock import VirtualClock
from pdflow.sim.faults import ACTION_KINDS, FAULT_KINDS, FAULT_PROFILES, draw_plan
from pdflow.sim.invariants import InvariantViolation, check_quiescent
from pdflow.sim.world import World


def test_plan_is_a_function_of_the_seed() -> None:
    assert draw_plan(11) == draw_plan(11)
    assert {draw_plan(s).shape for s in range(40)} != {draw_plan(0).shape}
    plan = draw_plan(5)
    assert set(plan.weights) == set(ACTION_KINDS) and set(ACTION_KINDS) >= FAULT_KINDS
    for seed in range(60):
        shape = draw_plan(seed).shape
        assert shape.prefill_ranks <= 4 and shape.decode_ranks <= 4
        if shape.policy is AllocationPolicy.PREFILL_COMPLETE:
            assert shape.decode_tp <= shape.prefill_tp


def test_clock_only_moves_forward() -> None:
    clock = VirtualClock()
    assert clock.advance(1.5) == 1.5
    assert clock.advance_to(1.0) == 1.5
    with pytest.raises(ValueError, match="forward"):
        clock.advance(0.0)


def happy_world(seed: int) -> World:
    """A world whose one request ran with no fault at all."""
    world = World(draw_plan(seed))
    apply(world, "new_request", 0, hint=8 << 3)
    settle(world)
    return world


@pytest.mark.parametrize("seed", range(8))
def test_a_request_without_faults_succeeds_on_both_sides_with_exact_bytes(seed: int) -> None:
    world = happy_world(seed)
    world.monitor.assert_ok()
    assert check_quiescent(world) == []
    outcomes = set(world.monitor.outcomes.values())
    assert outcomes == {KVPoll.Success}, world.monitor.outcomes
    assert world.transport.landed_bytes > 0


def test_every_enabled_action_changes_something() -> None:
    world = World(draw_plan(3))
    apply(world, "new_request", 0)
    for kind in ("open_decode", "open_prefill", "local_event"):
        before = (world.steps, len(world.local_events), len(world.network))
        apply(world, kind, 0)
        assert (world.steps, len(world.local_events), len(world.network)) != before
    with pytest.raises(ValueError, match="not enabled"):
        apply(world, "heal", 0)
    assert choices(world, "advance")


@pytest.mark.invariant("no_use_after_free")
def test_monitor_reports_a_write_into_freed_memory() -> None:
    world = World(draw_plan(4))
    apply(world, "new_request", 0)
    while not world.transport.writes:
        kind = next(
            k
            for k in (
                "local_event",
                "deliver",
                "open_decode",
                "open_prefill",
                "decode_allocate",
                "prefill_progress",
            )
            if choices(world, k)
        )
        apply(world, kind, 0, hint=1 << 20)
    write = next(iter(world.transport.writes.values()))
    # Pretend the ledger freed the pages (what releasing on abort without the ACK does).
    world.transport.owner_of = lambda rank, page: None
    world.transport.land(write)
    world.monitor.observe(world.decode[0], *_noop_step(world))
    with pytest.raises(InvariantViolation, match="use-after-free"):
        world.monitor.assert_ok()


def _noop_step(world: World):  # type: ignore[no-untyped-def]
    from pdflow.core.endpoints.endpoint_io import TimerFired
    from pdflow.core.framework.step import Step

    return TimerFired(), Step(), set(world.decode[0].endpoint.rooms)


def test_each_seed_runs_one_fault_profile_and_every_profile_is_drawn() -> None:
    """Swarm testing by feature omission: faults outside a seed's profile never happen."""
    plans = [draw_plan(seed) for seed in range(200)]
    assert {p.profile for p in plans} == set(FAULT_PROFILES)
    for plan in plans:
        outside = FAULT_KINDS - FAULT_PROFILES[plan.profile]
        assert all(plan.weights[kind] == 0.0 for kind in outside), plan.profile
    assert FAULT_PROFILES["all"] == FAULT_KINDS - {"pause_prefill", "late_registration"}
    focused = [kinds for name, kinds in FAULT_PROFILES.items() if name != "all"]
    assert set().union(*focused) == FAULT_KINDS, "every fault is focused on by some profile"
