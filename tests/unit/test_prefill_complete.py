"""PrefillCompleteTable: every cell of its table, and the promises of the deferred bootstrap."""

import pytest

from pdflow.core.endpoints.endpoint_io import Dropped
from pdflow.core.framework.errors import InvalidInput, ProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import AbortRequested, Input, Tick
from pdflow.core.protocol.messages import PeerId, StatusReport
from pdflow.core.protocol.outputs import SendMessage, emit_name
from pdflow.core.protocol.policy import Timeouts
from pdflow.core.rooms.prefill_complete import (
    DUPLICATE_ROOM,
    PREFILL_COMPLETE_TABLE,
    BootstrapArrived,
    BootstrapRoom,
    BootstrapRoomState,
    ClaimRoom,
    CloseRoom,
    Evicted,
    FailRoom,
    MarkComplete,
    OwnerRefused,
    PrefillCompleteTable,
    Superseded,
)

ME = PeerId("10.0.1.1:8000", "p1")
D1 = PeerId("10.0.2.1:9000", "d1")
D2 = PeerId("10.0.2.2:9000", "d2")
ROOM, GEN, OWNER = 5, 1, 7
TIMEOUTS = Timeouts(bootstrap_timeout=4.0, waiting_timeout=3.0)
TTL = 7.0


# ---- exhaustive cells --------------------------------------------------------------------------
SETUP: dict[BootstrapRoomState, list[Input]] = {
    BootstrapRoomState.ABSENT: [],
    BootstrapRoomState.UNOWNED: [BootstrapArrived(ROOM, GEN, D1)],
    BootstrapRoomState.OWNED: [ClaimRoom(ROOM, GEN, OWNER)],
    BootstrapRoomState.READY: [ClaimRoom(ROOM, GEN, OWNER), MarkComplete(ROOM, GEN, OWNER)],
    BootstrapRoomState.FAILED: [ClaimRoom(ROOM, GEN, OWNER), FailRoom(ROOM, GEN)],
    BootstrapRoomState.TOMBSTONE: [FailRoom(ROOM, GEN)],
}

SAMPLES: dict[str, Input] = {
    "ClaimRoom": ClaimRoom(ROOM, GEN, 8),
    "BootstrapArrived": BootstrapArrived(ROOM, GEN, D1),
    "MarkComplete": MarkComplete(ROOM, GEN, OWNER),
    "FailRoom": FailRoom(ROOM, GEN),
    "CloseRoom": CloseRoom(ROOM, GEN, OWNER, False),
    "Superseded": Superseded(ROOM, GEN, GEN + 1),
    "Evicted": Evicted(ROOM, GEN),
    "Tick": Tick(),
}


def _room_in(state: BootstrapRoomState) -> BootstrapRoom:
    room = BootstrapRoom(ROOM, GEN, ME, TTL, lambda: GEN)
    for inp in SETUP[state]:
        room.fire(inp, 0.0)
    assert room.state is state
    return room


def test_samples_cover_every_input_and_state() -> None:
    assert set(SAMPLES) == set(PREFILL_COMPLETE_TABLE.inputs)
    assert set(SETUP) == set(BootstrapRoomState)


@pytest.mark.parametrize("state", list(BootstrapRoomState), ids=lambda s: s.name)
@pytest.mark.parametrize("on", PREFILL_COMPLETE_TABLE.inputs)
def test_every_cell(state: BootstrapRoomState, on: str) -> None:
    room = _room_in(state)
    cell = PREFILL_COMPLETE_TABLE.cell(state, on)
    before = room.snapshot()
    if cell:
        _, fired = room.fire(SAMPLES[on], 1.0)
        assert room.state in {r.target for r in cell}
        assert fired.source == state.name
    else:
        with pytest.raises(ProtocolError) as refused:
            room.fire(SAMPLES[on], 1.0)
        assert refused.value.machine == "PrefillComplete"
        assert room.snapshot() == before


# ---- scenarios ---------------------------------------------------------------------------------
def _notices(step: Step) -> list[tuple[PeerId, KVPoll]]:
    found = []
    for out in step.outputs:
        assert emit_name(out) in ("send.status", "owner_refused")
        if isinstance(out, SendMessage):
            assert isinstance(out.message, StatusReport)
            found.append((out.to, out.message.status))
    return found


def _table() -> PrefillCompleteTable:
    return PrefillCompleteTable(ME, TIMEOUTS)


def test_at_most_one_owner() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    step = table.handle(ClaimRoom(ROOM, GEN, 8), 1.0)
    assert step.outputs == (OwnerRefused(ROOM, 8, DUPLICATE_ROOM),)
    table.handle(CloseRoom(ROOM, GEN, 8, False), 2.0)  # the refused sender cleans up
    table.handle(MarkComplete(ROOM, GEN, 8), 2.0)
    (room,) = table.snapshot().rooms
    assert (room.owner, room.state) == (OWNER, "OWNED")


def test_at_most_one_ready_notice() -> None:
    table = _table()
    table.handle(BootstrapArrived(ROOM, GEN, D1), 0.0)
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    sent = _notices(table.handle(MarkComplete(ROOM, GEN, OWNER), 1.0))
    sent += _notices(table.handle(MarkComplete(ROOM, GEN, OWNER), 2.0))
    sent += _notices(table.handle(BootstrapArrived(ROOM, GEN, D1), 3.0))
    assert sent == [(D1, KVPoll.WaitingForInput)]


def test_ready_before_the_bootstrap_waits_for_the_endpoint() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    assert _notices(table.handle(MarkComplete(ROOM, GEN, OWNER), 1.0)) == []
    assert _notices(table.handle(BootstrapArrived(ROOM, GEN, D1), 2.0)) == [
        (D1, KVPoll.WaitingForInput)
    ]
    assert _notices(table.handle(BootstrapArrived(ROOM, GEN, D1), 3.0)) == []


def test_failure_beats_a_late_ready() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    table.handle(BootstrapArrived(ROOM, GEN, D1), 0.0)
    sent = _notices(table.handle(FailRoom(ROOM, GEN, "aborted"), 1.0))
    sent += _notices(table.handle(MarkComplete(ROOM, GEN, OWNER), 2.0))
    sent += _notices(table.handle(FailRoom(ROOM, GEN), 3.0))
    assert sent == [(D1, KVPoll.Failed)]
    assert table.is_failed(ROOM, GEN)


def test_failure_after_ready_is_still_notified_once() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    table.handle(BootstrapArrived(ROOM, GEN, D1), 0.0)
    table.handle(MarkComplete(ROOM, GEN, OWNER), 1.0)
    sent = _notices(table.handle(FailRoom(ROOM, GEN), 2.0))
    sent += _notices(table.handle(CloseRoom(ROOM, GEN, OWNER, False), 3.0))
    assert sent == [(D1, KVPoll.Failed)]


def test_cancel_before_the_sender_exists_is_not_lost() -> None:
    table = _table()
    table.handle(FailRoom(ROOM, GEN, "aborted by the decode"), 0.0)
    assert table.handle(ClaimRoom(ROOM, GEN, OWNER), 1.0).outputs == (
        OwnerRefused(ROOM, OWNER, DUPLICATE_ROOM),
    )
    step = table.handle(BootstrapArrived(ROOM, GEN, D1), 2.0)
    ((to, message),) = [(o.to, o.message) for o in step.outputs if isinstance(o, SendMessage)]
    assert to == D1 and isinstance(message, StatusReport)
    assert (message.status, message.reason, message.generation) == (
        KVPoll.Failed,
        "aborted by the decode",
        GEN,
    )


def test_tombstone_expires_at_exactly_ttl() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 100.0)
    step = table.handle(CloseRoom(ROOM, GEN, OWNER, False), 100.0)
    assert step.timer_at == 100.0 + TTL
    table.handle(Tick(), 100.0 + TTL - 1e-6)
    assert table.state_of(ROOM, GEN) is BootstrapRoomState.TOMBSTONE
    step = table.handle(Tick(), 100.0 + TTL)
    assert table.state_of(ROOM, GEN) is BootstrapRoomState.ABSENT and step.timer_at is None
    assert table.handle(ClaimRoom(ROOM, 2, OWNER), 200.0).outputs == ()


def test_unowned_room_expires_at_ttl_but_owned_rooms_do_not() -> None:
    table = _table()
    table.handle(BootstrapArrived(ROOM, GEN, D1), 0.0)
    table.handle(ClaimRoom(6, GEN, OWNER), 0.0)
    assert table.timer_at() == TTL
    table.handle(Tick(), TTL)
    assert table.state_of(ROOM, GEN) is BootstrapRoomState.ABSENT
    assert table.state_of(6, GEN) is BootstrapRoomState.OWNED
    assert table.timer_at() is None


def test_success_close_deletes_the_room() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    table.handle(MarkComplete(ROOM, GEN, OWNER), 1.0)
    table.handle(CloseRoom(ROOM, GEN, OWNER, True), 2.0)
    assert table.snapshot().rooms == ()


def test_a_second_endpoint_is_refused_and_the_first_kept() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN, OWNER), 0.0)
    table.handle(BootstrapArrived(ROOM, GEN, D1), 0.0)
    assert _notices(table.handle(BootstrapArrived(ROOM, GEN, D2), 1.0)) == [(D2, KVPoll.Failed)]
    ready = _notices(table.handle(MarkComplete(ROOM, GEN, OWNER), 2.0))
    assert ready == [(D1, KVPoll.WaitingForInput)]


def test_an_earlier_generations_bootstrap_creates_nothing() -> None:
    table = _table()
    table.handle(ClaimRoom(ROOM, GEN + 1, OWNER), 0.0)
    before = table.snapshot()
    step = table.handle(BootstrapArrived(ROOM, GEN, D1), 1.0)
    assert step.outputs == () and table.snapshot() == before


@pytest.mark.parametrize("generation", [0, -1, -(2**40)])
def test_nothing_held_supersedes_no_generation_whatever_its_number(generation: int) -> None:
    """With nothing held for the room id, no generation is superseded: an empty table read as
    holding generation 0, so a negative generation's early bootstrap (or cancel) was dropped and
    its endpoint never told it was ready (or failed)."""
    table = _table()
    table.handle(BootstrapArrived(ROOM, generation, D1), 0.0)
    assert table.state_of(ROOM, generation) is BootstrapRoomState.UNOWNED
    table.handle(ClaimRoom(ROOM, generation, OWNER), 1.0)
    ready = _notices(table.handle(MarkComplete(ROOM, generation, OWNER), 2.0))
    assert ready == [(D1, KVPoll.WaitingForInput)]
    cancelled = _table()
    cancelled.handle(FailRoom(ROOM, generation), 0.0)
    assert cancelled.is_failed(ROOM, generation)


def test_a_later_generation_supersedes_a_waiting_endpoint_and_a_tombstone() -> None:
    """Bug A's table half: generation 1's tombstone (or waiting endpoint) never blocks the next
    generation of the room id; the endpoint waiting on generation 1 is told it failed."""
    table = _table()
    table.handle(BootstrapArrived(ROOM, GEN, D1), 0.0)
    step = table.handle(ClaimRoom(ROOM, GEN + 1, OWNER), 1.0)
    assert _notices(step) == [(D1, KVPoll.Failed)]
    assert table.state_of(ROOM, GEN) is BootstrapRoomState.ABSENT
    assert table.state_of(ROOM, GEN + 1) is BootstrapRoomState.OWNED
    table.handle(FailRoom(ROOM, GEN + 1), 2.0)
    table.handle(CloseRoom(ROOM, GEN + 1, OWNER, False), 3.0)
    assert table.state_of(ROOM, GEN + 1) is BootstrapRoomState.TOMBSTONE
    assert table.handle(BootstrapArrived(ROOM, GEN + 2, D2), 4.0).outputs == ()
    assert table.handle(ClaimRoom(ROOM, GEN + 2, OWNER), 4.0).outputs == ()
    assert table.held() == 1


def _dropped(step: Step) -> list[str]:
    return [o.kind for o in step.outputs if isinstance(o, Dropped)]


def test_ownerless_entries_are_capped_and_what_would_pass_the_cap_is_dropped() -> None:
    # Every stray bootstrap (or cancel) for a room id no engine opens was held for the whole
    # TTL, outside any cap: a peer could make a prefill hold unbounded state.
    table = PrefillCompleteTable(ME, TIMEOUTS, max_ownerless=2)
    table.handle(BootstrapArrived(1, GEN, D1), 0.0)
    table.handle(BootstrapArrived(2, GEN, D1), 0.0)
    table.handle(ClaimRoom(3, GEN, OWNER), 0.0)
    before = table.snapshot()
    assert _dropped(table.handle(BootstrapArrived(4, GEN, D1), 1.0)) == ["ready_table_full"]
    assert _dropped(table.handle(FailRoom(5, GEN), 1.0)) == ["ready_table_full"]
    assert table.snapshot() == before and table.ownerless() == 2
    # An entry that already exists still takes its inputs: the owned room is bootstrapped.
    table.handle(BootstrapArrived(3, GEN, D2), 1.0)
    ready = _notices(table.handle(MarkComplete(3, GEN, OWNER), 1.5))
    assert ready == [(D2, KVPoll.WaitingForInput)]
    # Its owner closing it unfinished tells the endpoint, and keeps no tombstone past the cap.
    closed = table.handle(CloseRoom(3, GEN, OWNER, False), 2.0)
    assert _notices(closed) == [(D2, KVPoll.Failed)]
    assert table.state_of(3, GEN) is BootstrapRoomState.ABSENT and table.ownerless() == 2
    table.handle(ClaimRoom(6, GEN, OWNER), 2.0)
    table.handle(FailRoom(6, GEN), 2.0)
    table.handle(CloseRoom(6, GEN, OWNER, False), 2.0)
    assert table.state_of(6, GEN) is BootstrapRoomState.ABSENT and table.held() == 2
    # A failure of a waiting entry keeps the count: the cancel reaches its decode.
    assert _notices(table.handle(FailRoom(2, GEN), 2.0)) == [(D1, KVPoll.Failed)]
    assert table.ownerless() == 2
    # Once the ownerless ones expire there is room again.
    table.handle(Tick(), TTL + 2.0)
    assert table.ownerless() == 0
    assert _dropped(table.handle(BootstrapArrived(4, GEN, D1), TTL + 2.0)) == []
    assert table.state_of(4, GEN) is BootstrapRoomState.UNOWNED


def test_past_the_cap_the_oldest_tombstone_makes_way_for_a_live_bootstrap() -> None:
    # A burst of failures filled the cap with tombstones, and the next early bootstrap of a
    # live room was dropped: its decode waited out its timeout for a prefill that would have
    # been ready. A tombstone only tells a late bootstrap of a room already failed.
    table = PrefillCompleteTable(ME, TIMEOUTS, max_ownerless=3)
    for room, at in ((1, 0.0), (2, 1.0)):  # owners close their rooms unfinished
        table.handle(ClaimRoom(room, GEN, OWNER), at)
        table.handle(CloseRoom(room, GEN, OWNER, False), at)
    table.handle(FailRoom(3, GEN), 2.0)  # a cancel before the sender
    assert table.ownerless() == 3
    step = table.handle(BootstrapArrived(10, GEN, D1), 3.0)
    assert _dropped(step) == [] and table.state_of(10, GEN) is BootstrapRoomState.UNOWNED
    assert table.state_of(1, GEN) is BootstrapRoomState.ABSENT  # the oldest went
    assert [(f.source, f.on, f.target) for f in step.fired][-1] == (
        "TOMBSTONE", "Evicted", "ABSENT")
    # A new tombstone (a cancel, an unfinished close) evicts the oldest one too.
    table.handle(FailRoom(11, GEN), 4.0)
    assert table.state_of(2, GEN) is BootstrapRoomState.ABSENT
    assert table.state_of(11, GEN) is BootstrapRoomState.TOMBSTONE
    table.handle(ClaimRoom(12, GEN, OWNER), 5.0)
    table.handle(CloseRoom(12, GEN, OWNER, False), 5.0)
    assert table.state_of(3, GEN) is BootstrapRoomState.ABSENT
    assert table.state_of(12, GEN) is BootstrapRoomState.TOMBSTONE and table.ownerless() == 3
    # Waiting decodes are never evicted: once every entry is one, the cap drops as before.
    for room in (20, 21):
        table.handle(BootstrapArrived(room, GEN, D2), 6.0)
    assert {table.state_of(r, GEN) for r in (11, 12)} == {BootstrapRoomState.ABSENT}
    assert _dropped(table.handle(BootstrapArrived(22, GEN, D2), 6.0)) == ["ready_table_full"]
    assert table.ownerless() == 3 and table.state_of(10, GEN) is BootstrapRoomState.UNOWNED


def test_the_table_takes_only_its_own_inputs() -> None:
    with pytest.raises(InvalidInput):
        _table().handle(AbortRequested(), 0.0)
