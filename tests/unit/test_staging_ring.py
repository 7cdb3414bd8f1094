"""StagingRing: every cell of its table, placement, readiness, and the staging stalls it avoids."""

import pytest

from pdflow.core.framework.errors import (
    InvalidInput,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from pdflow.core.protocol.inputs import Input
from pdflow.core.resources.staging_ring import (
    STAGING_RING_TABLE,
    Assign,
    CheckReady,
    Free,
    FreeRoom,
    RingState,
    StagingAssigned,
    StagingDeferred,
    StagingOversized,
    StagingReady,
    StagingRing,
    WatermarkAdvanced,
    watermark_allows,
)

CAPACITY = 100


# ---- exhaustive cells --------------------------------------------------------------------------
def _ring_in(state: RingState) -> StagingRing:
    ring = StagingRing(CAPACITY)
    if state is RingState.OCCUPIED:
        ring.handle(Assign(1, 0, 10), 0.0)
    assert ring.state is state
    return ring


SAMPLES: dict[str, Input] = {
    "Assign": Assign(2, 0, 10),
    "Free": Free(1, 0),
    "FreeRoom": FreeRoom(1),
    "CheckReady": CheckReady(1, 0),
}


def test_samples_cover_every_input() -> None:
    assert set(SAMPLES) == set(STAGING_RING_TABLE.inputs)


@pytest.mark.parametrize("state", list(RingState), ids=lambda s: s.name)
@pytest.mark.parametrize("on", STAGING_RING_TABLE.inputs)
def test_every_cell(state: RingState, on: str) -> None:
    ring = _ring_in(state)
    cell = STAGING_RING_TABLE.cell(state, on)
    before = ring.snapshot()
    if cell:
        step = ring.handle(SAMPLES[on], 1.0)
        assert ring.state in {r.target for r in cell}
        assert step.fired[0].source == state.name
    else:
        with pytest.raises(ProtocolError) as refused:
            ring.handle(SAMPLES[on], 1.0)
        assert refused.value.machine == "StagingRing"
        assert ring.snapshot() == before


# ---- placement ---------------------------------------------------------------------------------
def _assigned(ring: StagingRing, room: int, chunk: int, nbytes: int) -> StagingAssigned:
    (out,) = ring.handle(Assign(room, chunk, nbytes), 0.0).outputs
    assert isinstance(out, StagingAssigned)
    return out


def _ready(ring: StagingRing, room: int, chunk: int) -> bool:
    (out,) = ring.handle(CheckReady(room, chunk), 0.0).outputs
    assert isinstance(out, StagingReady | StagingDeferred)
    return isinstance(out, StagingReady)


def test_assign_wraps_to_offset_zero_of_the_next_round() -> None:
    ring = StagingRing(CAPACITY)
    assert (_assigned(ring, 1, 0, 60).offset, _assigned(ring, 1, 1, 30).offset) == (0, 60)
    wrapped = _assigned(ring, 2, 0, 50)
    assert (wrapped.offset, wrapped.round) == (0, 1)
    assert _ready(ring, 1, 1)  # round 0: nothing older exists
    assert not _ready(ring, 2, 0)  # [0, 50) of round 0 is still live
    step = ring.handle(Free(1, 0), 0.0)
    assert step.outputs == (WatermarkAdvanced(0, 60),)
    assert _ready(ring, 2, 0)


def test_each_transition_is_recorded_under_the_room_of_its_input() -> None:
    # One ring serves every room of its rank: a trace or coverage record names the room.
    ring = StagingRing(CAPACITY)
    steps = [ring.handle(inp, 0.0) for inp in (Assign(7, 0, 10), Assign(9, 0, 10), FreeRoom(7))]
    assert [(f.key, f.on) for step in steps for f in step.fired] == [
        (7, "Assign"),
        (9, "Assign"),
        (7, "FreeRoom"),
    ]


def test_deferred_carries_the_watermark_that_blocked_it() -> None:
    ring = StagingRing(CAPACITY)
    _assigned(ring, 1, 0, 80)
    _assigned(ring, 2, 0, 40)
    (out,) = ring.handle(CheckReady(2, 0), 0.0).outputs
    assert out == StagingDeferred(2, 0, 0, 1, 0, 0)


def test_oversized_fails_permanently_with_a_reason_and_changes_nothing() -> None:
    ring = StagingRing(CAPACITY)
    _assigned(ring, 1, 0, 10)
    before = ring.snapshot()
    (out,) = ring.handle(Assign(2, 0, CAPACITY + 1), 0.0).outputs
    assert isinstance(out, StagingOversized)
    assert out.reason.startswith("oversized") and out.capacity == CAPACITY
    assert ring.snapshot() == before


def test_a_requeued_chunk_is_counted_once_and_keeps_its_place() -> None:
    ring = StagingRing(CAPACITY)
    first = _assigned(ring, 1, 0, 30)
    head = ring.head
    assert _assigned(ring, 1, 0, 30) == first
    assert ring.head == head and ring.outstanding(1) == 1
    with pytest.raises(RemoteProtocolError, match="size never changes"):
        ring.handle(Assign(1, 0, 31), 0.0)
    with pytest.raises(RemoteProtocolError, match="positive"):
        ring.handle(Assign(1, 1, 0), 0.0)
    assert ring.outstanding(1) == 1


def test_freeing_a_younger_chunk_leaves_the_watermark() -> None:
    ring = StagingRing(CAPACITY)
    _assigned(ring, 1, 0, 10)
    _assigned(ring, 1, 1, 10)
    assert ring.handle(Free(1, 1), 0.0).outputs == ()
    assert (ring.watermark_round, ring.watermark_tail) == (0, 0)
    assert ring.handle(Free(1, 1), 0.0).outputs == ()  # duplicate free: harmless


def test_a_leaked_allocation_is_unpinned_by_freeing_its_room() -> None:
    """sglang#31217: a room that failed mid-transfer leaked its ring allocation, which pinned
    the watermark so every later chunk that wrapped over it deferred forever. Freeing the room
    on failure releases what it held and the watermark moves past it."""
    ring = StagingRing(CAPACITY)
    _assigned(ring, 1, 0, 40)  # room 1 fails; its chunk is never scattered
    _assigned(ring, 2, 0, 50)
    ring.handle(Free(2, 0), 0.0)
    _assigned(ring, 3, 0, 30)  # wraps over room 1's region
    assert not _ready(ring, 3, 0)
    step = ring.handle(FreeRoom(1), 0.0)
    assert step.outputs == (WatermarkAdvanced(1, 0),)
    assert _ready(ring, 3, 0) and ring.outstanding(1) == 0


def test_an_empty_ring_restarts_and_never_blocks() -> None:
    """sglang#37166: an empty ring never advanced its watermark, so a chunk that did not fit the
    tail waited for a free that would never come. Here emptying the ring restarts it at offset
    0 of a fresh round and any chunk is ready at once."""
    ring = StagingRing(CAPACITY)
    _assigned(ring, 1, 0, 70)
    assert ring.handle(Free(1, 0), 0.0).outputs == (WatermarkAdvanced(1, 0),)
    assert ring.state is RingState.EMPTY
    again = _assigned(ring, 2, 0, 90)
    assert (again.offset, again.round) == (0, 1)
    assert _ready(ring, 2, 0)


def test_freeing_a_room_that_holds_everything_empties_the_ring() -> None:
    ring = StagingRing(CAPACITY)
    _assigned(ring, 1, 0, 10)
    _assigned(ring, 1, 1, 10)
    ring.handle(FreeRoom(1), 0.0)
    assert ring.state is RingState.EMPTY and ring.snapshot().live == ()
    assert ring.handle(FreeRoom(1), 0.0).outputs == ()


def test_check_ready_needs_a_live_chunk() -> None:
    ring = StagingRing(CAPACITY)
    with pytest.raises(LocalProtocolError):
        ring.handle(CheckReady(1, 0), 0.0)
    _assigned(ring, 1, 0, 10)
    with pytest.raises(InvalidInput, match="Assign it first"):
        ring.handle(CheckReady(1, 1), 0.0)


@pytest.mark.parametrize(
    ("wm", "round_", "end", "ready"),
    [
        ((0, 0), 0, 100, True),
        ((0, 0), 1, 1, False),
        ((0, 40), 1, 40, True),
        ((0, 40), 1, 41, False),
        ((1, 0), 1, 100, True),
        ((1, 99), 3, 1, False),
        ((2, 0), 3, 0, True),
    ],
)
def test_readiness_rule(wm: tuple[int, int], round_: int, end: int, ready: bool) -> None:
    assert watermark_allows(wm[0], wm[1], round_, end) is ready


def test_is_ready_checks_the_region() -> None:
    ring = StagingRing(CAPACITY)
    with pytest.raises(InvalidInput, match="not inside"):
        ring.is_ready(50, 1, CAPACITY + 1)
    with pytest.raises(InvalidInput):
        StagingRing(0)
