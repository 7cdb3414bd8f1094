"""StagingRing under random assign / re-queue / free / room failure: safety and progress."""

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdflow.core.resources.staging_ring import (
    Allocation,
    Assign,
    CheckReady,
    Free,
    FreeRoom,
    RingState,
    StagingAssigned,
    StagingOversized,
    StagingReady,
    StagingRing,
)

CAPACITY = 64
ROOMS = st.integers(0, 3)
CHUNKS = st.integers(0, 3)


def _position(held: Allocation) -> int:
    return held.round * CAPACITY + held.offset


def _overlaps(a: Allocation, b: Allocation) -> bool:
    return a.offset < b.end and b.offset < a.end


class RingModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ring = StagingRing(CAPACITY)
        self.sizes: dict[tuple[int, int], int] = {}
        self.freed: list[Allocation] = []
        self.last_watermark = (0, 0)

    def _live(self) -> list[Allocation]:
        return list(self.ring.snapshot().live)

    @rule(room=ROOMS, chunk=CHUNKS, nbytes=st.integers(1, CAPACITY + 8))
    def assign(self, room: int, chunk: int, nbytes: int) -> None:
        key = (room, chunk)
        if key in self.ring.live:
            nbytes = self.ring.live[key].nbytes  # a re-queue asks for the same size
        counted = self.ring.outstanding(room)
        (out,) = self.ring.handle(Assign(room, chunk, nbytes), 0.0).outputs
        if nbytes > CAPACITY:
            assert isinstance(out, StagingOversized)
            return
        assert isinstance(out, StagingAssigned)
        assert out.offset >= 0 and out.offset + nbytes <= CAPACITY
        assert self.ring.outstanding(room) == counted + (0 if key in self.sizes else 1)
        self.sizes[key] = nbytes

    @precondition(lambda self: self.ring.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.ring.live)))
        self.freed.append(self.ring.live[key])
        del self.sizes[key]
        self.ring.handle(Free(*key), 0.0)

    @rule(room=ROOMS)
    def free_room(self, room: int) -> None:
        for key in [k for k in self.ring.live if k[0] == room]:
            self.freed.append(self.ring.live[key])
            del self.sizes[key]
        self.ring.handle(FreeRoom(room), 0.0)
        assert self.ring.outstanding(room) == 0

    @precondition(lambda self: self.ring.live)
    @rule(data=st.data())
    def check_ready(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.ring.live)))
        held = self.ring.live[key]
        (out,) = self.ring.handle(CheckReady(*key), 0.0).outputs
        assert isinstance(out, StagingReady) == self.ring.is_ready(
            held.offset, held.round, held.end
        )

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def ready_never_overlaps_an_older_live_allocation(self) -> None:
        live = self._live()
        for i, young in enumerate(live):
            if not self.ring.is_ready(young.offset, young.round, young.end):
                continue
            for old in live[:i]:
                assert not (old.round < young.round and _overlaps(old, young)), (old, young)

    @invariant()
    def a_round_never_overlaps_itself(self) -> None:
        live = self._live()
        for i, a in enumerate(live):
            assert all(not (a.round == b.round and _overlaps(a, b)) for b in live[i + 1 :])

    @invariant()
    def live_is_in_position_order_and_counted_once(self) -> None:
        live = self._live()
        assert [_position(a) for a in live] == sorted(_position(a) for a in live)
        assert {(a.room, a.chunk) for a in live} == set(self.sizes)
        assert self.ring.state is (RingState.OCCUPIED if live else RingState.EMPTY)

    @invariant()
    def watermark_is_monotone_and_passes_every_drained_chunk(self) -> None:
        wm = (self.ring.watermark_round, self.ring.watermark_tail)
        assert wm >= self.last_watermark
        self.last_watermark = wm
        live = self._live()
        wm_position = wm[0] * CAPACITY + wm[1]
        if live:
            assert wm_position == _position(live[0])
        oldest_live = _position(live[0]) if live else None
        for gone in self.freed:
            if oldest_live is None or _position(gone) < oldest_live:
                assert wm_position > _position(gone)

    def teardown(self) -> None:
        # Progress: once everything is freed, any chunk that fits is writable at once.
        for room in range(4):
            self.ring.handle(FreeRoom(room), 0.0)
        assert self.ring.state is RingState.EMPTY
        (out,) = self.ring.handle(Assign(9, 0, CAPACITY), 0.0).outputs
        assert isinstance(out, StagingAssigned)
        assert self.ring.handle(CheckReady(9, 0), 0.0).outputs[0] == StagingReady(
            9, 0, out.offset, out.round
        )


RingModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("PDFLOW_EXAMPLES", "60")),
    stateful_step_count=30,
    deadline=None,
)
TestRingModel = RingModel.TestCase
