"""StagingRing: the decode's staging buffer (heterogeneous TP, small rooms), an overcommitting ring.

``Assign`` hands out ``(offset, round)`` at the head and wraps to offset 0 with ``round + 1``
when the tail of the ring cannot hold the chunk; it never waits, so a new chunk may overlap an
older one that is still live. The *watermark* ``(round, tail)`` says how far the ring is known
free: it sits at the oldest live allocation, and when the ring empties, the ring restarts at
offset 0 of a fresh round so an idle ring never pins a writer (sglang#37166). A writer may
write its chunk only when :func:`watermark_allows` says the region is free, else it defers.
Freeing every allocation of a failed room unpins the watermark (sglang#31217).

Positions are *round-adjusted*: ``round * capacity + offset``. Allocation order is position
order, so the oldest live allocation is the first one still in ``live``.
See ``[machines.StagingRing]`` in spec/machines/staging_ring.toml.
"""

from __future__ import annotations

import enum

import msgspec

from pdflow.core.framework.errors import InvalidInput, RemoteProtocolError
from pdflow.core.framework.table import Fired, Table, TableMachine, row
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.outputs import Output

SMALL_ROOM_STAGING_LIMIT = 64 * 1024
"""The largest room a decode may stage as a small room (``stage_rooms_up_to``). A host-memory
prefill that allocates its own slots makes each at least this size; every prefill registers
its slot size, and a decode stages a small room only for a prefill whose slots hold it."""


class RingState(enum.Enum):
    EMPTY = "EMPTY"
    OCCUPIED = "OCCUPIED"


# ---- inputs ------------------------------------------------------------------------------------
class Assign(Input, frozen=True, tag="Assign"):
    """A prefill asks for staging space for one chunk of a room (re-sent when re-queued)."""

    room: int
    chunk: int
    nbytes: int


class Free(Input, frozen=True, tag="Free"):
    """The chunk was scattered out of the staging buffer: its region may be reused."""

    room: int
    chunk: int


class FreeRoom(Input, frozen=True, tag="FreeRoom"):
    """The room is over (done or failed): free whatever it still holds."""

    room: int


class CheckReady(Input, frozen=True, tag="CheckReady"):
    """May this live chunk be written now, or must the writer defer?"""

    room: int
    chunk: int


# ---- outputs -----------------------------------------------------------------------------------
class StagingAssigned(Output, frozen=True, tag="staging_assigned"):
    room: int
    chunk: int
    offset: int
    round: int
    nbytes: int


class StagingOversized(Output, frozen=True, tag="staging_oversized"):
    """Permanent: the chunk can never fit. Fail the room; retrying cannot help."""

    room: int
    chunk: int
    nbytes: int
    capacity: int
    reason: str


class StagingReady(Output, frozen=True, tag="staging_ready"):
    room: int
    chunk: int
    offset: int
    round: int


class StagingDeferred(Output, frozen=True, tag="staging_deferred"):
    """An older live allocation may still occupy the region: ask again after the watermark moves."""

    room: int
    chunk: int
    offset: int
    round: int
    watermark_round: int
    watermark_tail: int


class WatermarkAdvanced(Output, frozen=True, tag="watermark_advanced"):
    """Broadcast to writers: every region before ``(round, tail)`` is free."""

    round: int
    tail: int


# ---- observable state ----------------------------------------------------------------------
class Allocation(msgspec.Struct, frozen=True):
    room: int
    chunk: int
    offset: int
    round: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class RingSnapshot(msgspec.Struct, frozen=True):
    state: str
    capacity: int
    head: int
    round: int
    watermark_round: int
    watermark_tail: int
    live: tuple[Allocation, ...]


def watermark_allows(watermark_round: int, watermark_tail: int, round: int, end: int) -> bool:
    """The readiness rule (sglang ``is_watermark_ready``): is ``[offset, end)`` of ``round`` free?

    The region was last used in ``round - 1``; it is free once the watermark is past the end of
    it there. In round 0 nothing older exists.
    """
    return (
        round <= 0
        or round - 1 < watermark_round
        or (round - 1 == watermark_round and end <= watermark_tail)
    )


_R = RingState
_ASSIGNED = "staging_assigned"
_WATERMARK = "watermark_advanced"


class StagingRing(TableMachine[RingState]):
    """The staging ring of one decode rank. Drive it with :meth:`handle`."""

    table: Table[RingState]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise InvalidInput(f"staging capacity must be positive bytes, got {capacity}")
        self.key = 0
        self.state = STAGING_RING_TABLE.initial
        self.capacity = capacity
        self.head = 0
        self.round = 0
        self.watermark_round = 0
        self.watermark_tail = 0
        self.live: dict[tuple[int, int], Allocation] = {}

    # ---- public API ----------------------------------------------------------------------------
    def fire(self, inp: Input, now: float) -> tuple[list[Output], Fired]:
        """As every table machine fires, but one ring serves many rooms: the transition is
        recorded under the input's room."""
        outputs, fired = super().fire(inp, now)
        room: int = getattr(inp, "room", self.key)
        return outputs, msgspec.structs.replace(fired, key=room)

    def is_ready(self, offset: int, round: int, end: int) -> bool:
        """May ``[offset, end)`` of ``round`` be written, given the current watermark?"""
        if not 0 <= offset <= end <= self.capacity:
            raise InvalidInput(
                f"region [{offset}, {end}) is not inside the ring [0, {self.capacity})"
            )
        return watermark_allows(self.watermark_round, self.watermark_tail, round, end)

    def outstanding(self, room: int) -> int:
        """Live chunks of the room, each counted once however often it was re-queued."""
        return sum(1 for r, _ in self.live if r == room)

    def snapshot(self) -> RingSnapshot:
        return RingSnapshot(
            state=self.state.name,
            capacity=self.capacity,
            head=self.head,
            round=self.round,
            watermark_round=self.watermark_round,
            watermark_tail=self.watermark_tail,
            live=tuple(self.live.values()),
        )

    # ---- validation ----------------------------------------------------------------------------
    def _validate(self, inp: Input, now: float) -> None:
        if isinstance(inp, Assign):
            if inp.nbytes <= 0:
                raise RemoteProtocolError(
                    f"room {inp.room} chunk {inp.chunk}: nbytes must be positive, got {inp.nbytes}"
                )
            known = self.live.get((inp.room, inp.chunk))
            if known is not None and known.nbytes != inp.nbytes:
                raise RemoteProtocolError(
                    f"room {inp.room} chunk {inp.chunk} re-queued with {inp.nbytes} bytes but was "
                    f"assigned {known.nbytes}; a chunk's size never changes"
                )
        elif isinstance(inp, CheckReady) and (inp.room, inp.chunk) not in self.live:
            raise InvalidInput(
                f"room {inp.room} chunk {inp.chunk} holds no staging space; "
                "Assign it first (or its room was already freed)"
            )

    # ---- guards --------------------------------------------------------------------------------
    def _guard_oversized(self, inp: Assign, now: float) -> bool:
        return inp.nbytes > self.capacity

    def _guard_already_assigned(self, inp: Assign, now: float) -> bool:
        assign = inp
        return (assign.room, assign.chunk) in self.live

    def _guard_tail_too_short(self, inp: Assign, now: float) -> bool:
        return self.head + inp.nbytes > self.capacity

    def _guard_is_live(self, inp: Free, now: float) -> bool:
        free = inp
        return (free.room, free.chunk) in self.live

    def _guard_frees_last(self, inp: Free, now: float) -> bool:
        return self._guard_is_live(inp, now) and len(self.live) == 1

    def _guard_frees_oldest(self, inp: Free, now: float) -> bool:
        free = inp
        return self._oldest_key() == (free.room, free.chunk)

    def _guard_room_holds_all(self, inp: FreeRoom, now: float) -> bool:
        room = inp.room
        return all(r == room for r, _ in self.live)

    def _guard_room_holds_oldest(self, inp: FreeRoom, now: float) -> bool:
        return self._oldest_key()[0] == inp.room

    def _guard_region_free(self, inp: CheckReady, now: float) -> bool:
        check = inp
        held = self.live[(check.room, check.chunk)]
        return self.is_ready(held.offset, held.round, held.end)

    # ---- actions -------------------------------------------------------------------------------
    def _act_refuse_oversized(self, inp: Assign, now: float) -> list[Output]:
        assign = inp
        reason = (
            f"oversized: chunk {assign.chunk} of room {assign.room} needs {assign.nbytes} bytes "
            f"but the whole staging ring holds {self.capacity}; enlarge the staging pool or "
            "use smaller chunks (chunked_prefill_size)"
        )
        return [StagingOversized(assign.room, assign.chunk, assign.nbytes, self.capacity, reason)]

    def _act_assign(self, inp: Assign, now: float) -> list[Output]:
        assign = inp
        held = Allocation(assign.room, assign.chunk, self.head, self.round, assign.nbytes)
        self.live[(assign.room, assign.chunk)] = held
        self.head = held.end
        return [self._assigned(held)]

    def _act_wrap_and_assign(self, inp: Assign, now: float) -> list[Output]:
        self.round += 1
        self.head = 0
        return self._act_assign(inp, now)

    def _act_repeat_assignment(self, inp: Assign, now: float) -> list[Output]:
        assign = inp
        return [self._assigned(self.live[(assign.room, assign.chunk)])]

    def _act_free(self, inp: Free, now: float) -> list[Output]:
        free = inp
        del self.live[(free.room, free.chunk)]
        return []

    def _act_free_and_advance(self, inp: Free, now: float) -> list[Output]:
        self._act_free(inp, now)
        return self._advance_watermark()

    def _act_free_and_restart(self, inp: Free, now: float) -> list[Output]:
        self._act_free(inp, now)
        return self._restart()

    def _act_free_room(self, inp: FreeRoom, now: float) -> list[Output]:
        room = inp.room
        self.live = {key: held for key, held in self.live.items() if key[0] != room}
        return []

    def _act_free_room_and_advance(self, inp: FreeRoom, now: float) -> list[Output]:
        self._act_free_room(inp, now)
        return self._advance_watermark()

    def _act_free_room_and_restart(self, inp: FreeRoom, now: float) -> list[Output]:
        self._act_free_room(inp, now)
        return self._restart()

    def _act_report_ready(self, inp: CheckReady, now: float) -> list[Output]:
        check = inp
        held = self.live[(check.room, check.chunk)]
        return [StagingReady(held.room, held.chunk, held.offset, held.round)]

    def _act_defer(self, inp: CheckReady, now: float) -> list[Output]:
        check = inp
        held = self.live[(check.room, check.chunk)]
        return [
            StagingDeferred(
                held.room,
                held.chunk,
                held.offset,
                held.round,
                self.watermark_round,
                self.watermark_tail,
            )
        ]

    # ---- helpers -------------------------------------------------------------------------------
    def _oldest_key(self) -> tuple[int, int]:
        return next(iter(self.live))

    def _assigned(self, held: Allocation) -> StagingAssigned:
        return StagingAssigned(held.room, held.chunk, held.offset, held.round, held.nbytes)

    def _advance_watermark(self) -> list[Output]:
        oldest = self.live[self._oldest_key()]
        self.watermark_round, self.watermark_tail = oldest.round, oldest.offset
        return [WatermarkAdvanced(self.watermark_round, self.watermark_tail)]

    def _restart(self) -> list[Output]:
        # An empty ring starts a fresh round at offset 0: nothing older can overlap anything.
        self.round += 1
        self.head = 0
        self.watermark_round, self.watermark_tail = self.round, 0
        return [WatermarkAdvanced(self.watermark_round, self.watermark_tail)]


_M = StagingRing
STAGING_RING_TABLE: Table[RingState] = Table(
    machine="StagingRing",
    states=RingState,
    initial=RingState.EMPTY,
    inputs=(Assign, Free, FreeRoom, CheckReady),
    remote_inputs=(Assign,),
    rows=[
        # -- EMPTY: nothing live; the head is at offset 0 of the current round -------------------
        row(_R.EMPTY, Assign, _R.EMPTY,
            guard=_M._guard_oversized, emits=["staging_oversized"],
            action=_M._act_refuse_oversized),
        row(_R.EMPTY, Assign, _R.OCCUPIED, emits=[_ASSIGNED], action=_M._act_assign),
        row(_R.EMPTY, Free, _R.EMPTY),  # late or duplicate free: harmless
        row(_R.EMPTY, FreeRoom, _R.EMPTY),
        # -- OCCUPIED: at least one live allocation ----------------------------------------------
        row(_R.OCCUPIED, Assign, _R.OCCUPIED,
            guard=_M._guard_already_assigned, emits=[_ASSIGNED], action=_M._act_repeat_assignment),
        row(_R.OCCUPIED, Assign, _R.OCCUPIED,
            guard=_M._guard_oversized, emits=["staging_oversized"],
            action=_M._act_refuse_oversized),
        row(_R.OCCUPIED, Assign, _R.OCCUPIED,
            guard=_M._guard_tail_too_short, emits=[_ASSIGNED], action=_M._act_wrap_and_assign),
        row(_R.OCCUPIED, Assign, _R.OCCUPIED, emits=[_ASSIGNED], action=_M._act_assign),
        row(_R.OCCUPIED, Free, _R.EMPTY,
            guard=_M._guard_frees_last, emits=[_WATERMARK], action=_M._act_free_and_restart),
        row(_R.OCCUPIED, Free, _R.OCCUPIED,
            guard=_M._guard_frees_oldest, emits=[_WATERMARK], action=_M._act_free_and_advance),
        row(_R.OCCUPIED, Free, _R.OCCUPIED, guard=_M._guard_is_live, action=_M._act_free),
        row(_R.OCCUPIED, Free, _R.OCCUPIED),  # late or duplicate free: harmless
        row(_R.OCCUPIED, FreeRoom, _R.EMPTY,
            guard=_M._guard_room_holds_all, emits=[_WATERMARK],
            action=_M._act_free_room_and_restart),
        row(_R.OCCUPIED, FreeRoom, _R.OCCUPIED,
            guard=_M._guard_room_holds_oldest, emits=[_WATERMARK],
            action=_M._act_free_room_and_advance),
        row(_R.OCCUPIED, FreeRoom, _R.OCCUPIED, action=_M._act_free_room),
        row(_R.OCCUPIED, CheckReady, _R.OCCUPIED,
            guard=_M._guard_region_free, emits=["staging_ready"], action=_M._act_report_ready),
        row(_R.OCCUPIED, CheckReady, _R.OCCUPIED, emits=["staging_deferred"], action=_M._act_defer),
    ],
)  # fmt: skip
StagingRing.table = STAGING_RING_TABLE
