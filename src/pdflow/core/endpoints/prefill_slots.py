"""The prefill endpoint's room slots: which generation of a room id a message or call belongs to.

One slot per (room id, generation), from first sight to forgotten. Its state is not stored per
generation but read off one small record per room id (the highest generation the engine
opened, the highest generation cancelled before it opened, at most one parked generation) and
off the rooms the endpoint hosts, so what a rank keeps per room id is bounded however many
generations fail or how many stray messages arrive. Every rule is a row of
``[machines.PrefillRoomSlot]`` (spec/machines/room_slots.toml):

- ABSENT: newer than every generation opened or cancelled, nothing parked for it.
- PARKED: metadata waits for the engine to open this generation (expires).
- CANCELLED: an ABORT came first and was ACKed; opening it fails at once, forever. A newer
  generation opening first does not end the cancel (the engine may open an older one later):
  it is kept, and keeps the room id's opened mark, until the only cancelled generation opens.
- OPEN: the engine's room (a SenderRoom).
- DRAINING: the engine cleared it while writes were in flight; removed when they drain.
- REMOVED: at or below the opened high-water mark and not hosted: finished (or skipped); its
  metadata is stale, and an open of it is refused, by the mark alone. The marks of room ids
  holding nothing else are forgotten past ``max_finished_room_ids`` (opened_marks.py), after
  which a late open of a skipped generation would read as a new room id's and succeed. So a
  late ABORT is kept nowhere only for the mark's own generation (opened, and the engine opens
  a generation once); one below the mark, which may never have opened, is ACKed as a cancel
  promise in the room id's record, which keeps the mark, or, for a room id holding no record
  past ``max_pending_room_ids``, not ACKed at all: an AbortAck for (room, generation) goes out
  only when no open of it can succeed afterwards.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from pdflow.core.endpoints.endpoint_io import Dropped, RoomRemoved
from pdflow.core.endpoints.opened_marks import NONE, OpenedMarks
from pdflow.core.endpoints.room_host import REMOVED_ROOMS_COUNTER
from pdflow.core.endpoints.slot_inputs import CLEAR_HINT, ClearSlot, OpenSlot
from pdflow.core.framework.deadlines import DeadlineQueue
from pdflow.core.framework.errors import RemoteProtocolError
from pdflow.core.framework.step import Fired
from pdflow.core.framework.table import Table, TableMachine, row
from pdflow.core.protocol.inputs import (
    AbortArrived,
    AbortRequested,
    Input,
    MetadataArrived,
    Tick,
    TransferCompleted,
)
from pdflow.core.protocol.messages import Abort, AbortAck, PeerId, RoomMetadata
from pdflow.core.protocol.outputs import Output, SendMessage
from pdflow.core.rooms.sender_room import SenderRoom, SenderState


class SlotState(enum.Enum):
    ABSENT = "ABSENT"
    PARKED = "PARKED"
    CANCELLED = "CANCELLED"
    OPEN = "OPEN"
    DRAINING = "DRAINING"
    REMOVED = "REMOVED"


# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_ABSENT, _PARKED, _CANCELLED = SlotState.ABSENT, SlotState.PARKED, SlotState.CANCELLED
_OPEN, _DRAINING = SlotState.OPEN, SlotState.DRAINING
_REMOVED_STATE = SlotState.REMOVED  # (_REMOVED, below, is the spec's name of RoomRemoved)
_SENDER_DRAINING = SenderState.DRAINING


@dataclass(slots=True)
class PendingRecord:
    """What a room id holds for generations the engine has not opened yet: O(1) per room id."""

    cancelled: int = NONE
    """Highest generation ACK-cancelled that the endpoint cannot tell opened: before the engine
    opened it, or (an ABORT below the opened mark) perhaps never."""
    cancelled_lowest: int = NONE
    """Lowest one. The record is kept until the engine opens the only cancelled generation
    (lowest == highest): an engine may open an older generation after a newer one, so a later
    open does not end a cancel, and the record also keeps the room id's opened mark, which
    refuses the late open of one below it (for good: that open never succeeds)."""
    parked_generation: int = NONE
    parked: dict[PeerId, RoomMetadata] = field(default_factory=dict)
    parked_until: float | None = None


_NO_RECORD = PendingRecord()
"""What a room id without a record reads as (never written: a rule that writes makes its own)."""


class SlotHost(Protocol):
    """What the slot needs from its prefill endpoint."""

    rooms: dict[int, SenderRoom]
    draining: dict[tuple[int, int], SenderRoom]
    opened: OpenedMarks
    """Per room id, the highest generation the engine opened (the least recently opened
    forgotten past max_finished_room_ids, once nothing of the room id is held)."""
    pending: dict[int, PendingRecord]
    parking_deadlines: DeadlineQueue[int]
    bootstrap_timeout: float
    max_pending_room_ids: int
    max_parked_peers: int

    def host_sender(self, room: int, generation: int, now: float) -> SenderRoom: ...

    def room_input(self, room: SenderRoom, inp: Input, now: float) -> None: ...

    def fail_unopened(self, room: int, generation: int, reason: str, now: float) -> None: ...

    def close_sender(self, room: SenderRoom, now: float) -> None: ...

    def hold_draining(self, room: SenderRoom) -> None: ...

    def release_drained(self, room: SenderRoom) -> None: ...

    def count(self, counter: str) -> None: ...

    def ack(self, abort: Abort) -> SendMessage: ...


class PrefillRoomSlot(TableMachine[SlotState]):
    """One (room id, generation) slot, rebuilt from its room id's record for each input."""

    table: Table[SlotState]

    def __init__(self, host: SlotHost, room: int, generation: int) -> None:
        self.host = host
        self.at(room, generation)

    def at(self, room: int, generation: int) -> PrefillRoomSlot:
        """Re-point this slot at (room, generation), its state read afresh off the room id's
        record and the hosted rooms: the endpoint keeps one slot and re-points it per input
        (nothing of a slot outlives its step), instead of building one per input."""
        self.key = room
        self.generation = generation
        self._record = self.host.pending.get(room)
        self.state = self._classify()
        return self

    @property
    def record(self) -> PendingRecord:
        """The room id's record: its pending one, else a fresh one, made only when a rule reads
        it (most inputs are for open rooms, whose room ids hold none)."""
        if self._record is None:
            self._record = PendingRecord()
        return self._record

    def _classify(self) -> SlotState:
        hosted = self.host.rooms.get(self.key)
        if hosted is not None and hosted.generation == self.generation:
            return _OPEN  # (most inputs: the record is read only past this)
        record = self._record or _NO_RECORD
        if (self.key, self.generation) in self.host.draining:
            return _DRAINING
        if self.generation <= self.host.opened.get(self.key, NONE):
            return _REMOVED_STATE
        if self.generation <= record.cancelled:
            return _CANCELLED
        if self.generation == record.parked_generation:
            return _PARKED
        return _ABSENT

    def step(self, inp: Input, now: float) -> tuple[list[Output], Fired]:
        """Fire the input, then keep the room id's record only while it holds something."""
        outputs, fired = self.fire(inp, now)
        record = self._record
        if record is None:
            # The room id held no record and no rule made one: nothing to keep, and nothing
            # armed (a parking deadline is armed only while its record is kept).
            return outputs, fired
        if record.parked_generation != NONE or record.cancelled != NONE:
            self.host.pending[self.key] = record
        else:
            self.host.pending.pop(self.key, None)
        parked_until = record.parked_until if record.parked_generation != NONE else None
        self.host.parking_deadlines.arm(self.key, parked_until)
        return outputs, fired

    def _hosted(self) -> SenderRoom:
        room = self.host.rooms.get(self.key)
        if room is not None and room.generation == self.generation:
            return room
        return self.host.draining[(self.key, self.generation)]

    # ---- guards --------------------------------------------------------------------------------
    def _guard_older_than_parked(self, inp: MetadataArrived, now: float) -> bool:
        return self.record.parked_generation > self.generation

    def _guard_unopened_full(self, inp: MetadataArrived | AbortArrived, now: float) -> bool:
        fresh = self.key not in self.host.pending
        return fresh and len(self.host.pending) >= self.host.max_pending_room_ids

    def _guard_parking_full(self, inp: MetadataArrived, now: float) -> bool:
        parked = self.record.parked
        return inp.metadata.decode not in parked and len(parked) >= self.host.max_parked_peers

    def _guard_parking_expired(self, inp: Tick, now: float) -> bool:
        until = self.record.parked_until
        return until is not None and now >= until

    def _guard_opened_mark(self, inp: AbortArrived, now: float) -> bool:
        return self.generation == self.host.opened.get(self.key, NONE)

    def _guard_writes_in_flight(self, inp: ClearSlot, now: float) -> bool:
        room = self._hosted()
        return room.state is _SENDER_DRAINING

    def _guard_room_terminal(self, inp: ClearSlot, now: float) -> bool:
        return self._hosted().poll.is_terminal

    def _guard_drains_last_write(self, inp: TransferCompleted, now: float) -> bool:
        room = self._hosted()
        return set(room.outstanding) == {inp.seq}

    # ---- actions -------------------------------------------------------------------------------
    def _act_open(self, inp: OpenSlot, now: float) -> list[Output]:
        # Only read, unless something is parked (then the room id holds a record).
        record = self._record or _NO_RECORD
        parked = record.parked if record.parked_generation == self.generation else {}
        if NONE < record.parked_generation <= self.generation:
            self._forget_parked()
        self.host.opened.opened(self.key, self.generation)
        room = self.host.host_sender(self.key, self.generation, now)
        refused: list[Output] = []
        for metadata in parked.values():
            try:
                self.host.room_input(room, MetadataArrived(metadata), now)
            except RemoteProtocolError as exc:
                # A peer's message the room refuses (decode peers that disagree, one too
                # many): dropped and counted as it would be had it come after the open. Raised,
                # it would fail the engine's open of a room this step already opened.
                refused.append(self._drop("protocol_error", f"parked metadata: {exc}"))
        return refused

    def _act_open_cancelled(self, inp: OpenSlot, now: float) -> list[Output]:
        self._act_open(inp, now)
        room = self.host.rooms[self.key]
        if not room.poll.is_terminal:
            reason = "cancelled by the decode before the room opened"
            self.host.room_input(room, AbortRequested(reason), now)
        record = self.record
        if record.cancelled_lowest == record.cancelled == self.generation:
            # The only cancelled generation opened (and failed): no promise is left to keep.
            record.cancelled = record.cancelled_lowest = NONE
        return []

    def _act_park(self, inp: MetadataArrived, now: float) -> list[Output]:
        record = self.record
        if record.parked_generation != self.generation:
            if record.parked_generation != NONE:
                self.host.count("parked_superseded")
            record.parked = {}
            record.parked_generation = self.generation
            record.parked_until = now + self.host.bootstrap_timeout
        record.parked[inp.metadata.decode] = inp.metadata
        return []

    def _act_cancel(self, inp: AbortArrived, now: float) -> list[Output]:
        # Nothing of an unopened generation can be writing: ACK now. The ACK promises that this
        # generation never writes, so it stays cancelled (no expiry) until it or a later one opens.
        record = self.record
        self._promise(self.generation)
        if NONE < record.parked_generation <= self.generation:
            self._forget_parked()
        self.host.fail_unopened(self.key, self.generation, "aborted by decode", now)
        return [self.host.ack(inp.abort)]

    def _act_ack(self, inp: AbortArrived, now: float) -> list[Output]:
        return [self.host.ack(inp.abort)]

    def _act_ack_cancelled(self, inp: AbortArrived, now: float) -> list[Output]:
        self._promise(self.generation)  # it may lie below the lowest cancelled generation
        return [self.host.ack(inp.abort)]

    def _act_ack_below_mark(self, inp: AbortArrived, now: float) -> list[Output]:
        # Only the mark refuses a late open of this generation, which may never have opened:
        # the promise keeps the record, and the record keeps the mark (never forgotten).
        self._promise(self.generation)
        return [self.host.ack(inp.abort)]

    def _act_forget_parked(self, inp: Tick, now: float) -> list[Output]:
        self._forget_parked()
        self.host.count("early_arrivals_expired")
        return []

    def _act_deliver_metadata(self, inp: MetadataArrived, now: float) -> list[Output]:
        self.host.room_input(self._hosted(), inp, now)
        return []

    def _act_deliver_abort(self, inp: AbortArrived, now: float) -> list[Output]:
        self.host.room_input(self._hosted(), inp, now)
        return []

    def _act_deliver_write(self, inp: TransferCompleted, now: float) -> list[Output]:
        self.host.room_input(self._hosted(), inp, now)
        return []

    def _act_start_draining(self, inp: ClearSlot, now: float) -> list[Output]:
        room = self.host.rooms.pop(self.key)
        self.host.hold_draining(room)
        self.host.close_sender(room, now)
        return []

    def _act_remove(self, inp: ClearSlot, now: float) -> list[Output]:
        room = self.host.rooms.pop(self.key)
        self.host.close_sender(room, now)
        return [self._removed(room)]

    def _act_drain_and_remove(self, inp: TransferCompleted, now: float) -> list[Output]:
        room = self.host.draining[(self.key, self.generation)]
        self.host.room_input(room, inp, now)
        self.host.release_drained(room)
        return [self._removed(room)]

    def _act_drop_stale(self, inp: MetadataArrived, now: float) -> list[Output]:
        return [self._drop("stale_generation", "metadata for an earlier generation")]

    def _act_drop_superseded(self, inp: MetadataArrived, now: float) -> list[Output]:
        return [self._drop("superseded_generation", "a later generation is already parked")]

    def _act_drop_cancelled(self, inp: MetadataArrived, now: float) -> list[Output]:
        return [self._drop("aborted_room", "metadata for a cancelled generation")]

    def _act_drop_parking_full(self, inp: MetadataArrived, now: float) -> list[Output]:
        return [self._drop("parking_full", f"more than {self.host.max_parked_peers} decode peers")]

    def _act_drop_unopened_full(
        self, inp: MetadataArrived | AbortArrived, now: float
    ) -> list[Output]:
        kind = type(inp).__name__
        cap = self.host.max_pending_room_ids
        return [self._drop("unopened_full", f"{kind}: {cap} room ids pending")]

    # ---- helpers -------------------------------------------------------------------------------
    def _promise(self, generation: int) -> None:
        """An ACK promises ``generation`` never writes: O(1), the floor and its lowest one."""
        record = self.record
        record.cancelled = max(record.cancelled, generation)
        lowest = record.cancelled_lowest
        record.cancelled_lowest = generation if lowest == NONE else min(lowest, generation)

    def _forget_parked(self) -> None:
        record = self.record
        record.parked_generation = NONE
        record.parked = {}
        record.parked_until = None

    def _drop(self, kind: str, why: str) -> Dropped:
        self.host.count(f"dropped_{kind}")
        return Dropped(kind, f"room {self.key}/{self.generation}: {why}")

    def _removed(self, room: SenderRoom) -> RoomRemoved:
        self.host.count(REMOVED_ROOMS_COUNTER[room.poll])
        return RoomRemoved(room.key, room.generation)


_P = SlotState
_ACK = "send.abort_ack"
_DROPPED = "dropped"
_REMOVED = "room_removed"
_S = PrefillRoomSlot

PREFILL_SLOT_TABLE: Table[SlotState] = Table(
    machine="PrefillRoomSlot",
    states=SlotState,
    initial=SlotState.ABSENT,
    inputs=(OpenSlot, MetadataArrived, AbortArrived, ClearSlot, TransferCompleted, Tick),
    remote_inputs=(MetadataArrived, AbortArrived),
    hints={
        "OpenSlot": (
            "a room id opens each generation once, and only a later one than it opened: "
            "fail a request for an earlier generation without opening it"
        ),
        "ClearSlot": CLEAR_HINT,
        "TransferCompleted": "report each StartTransfer of a hosted room exactly once",
    },
    rows=[
        # -- ABSENT: a generation newer than any opened or cancelled ------------------------------
        row(_P.ABSENT, OpenSlot, _P.OPEN, action=_S._act_open),
        row(_P.ABSENT, MetadataArrived, _P.ABSENT,
            guard=_S._guard_older_than_parked, emits=[_DROPPED], action=_S._act_drop_superseded),
        row(_P.ABSENT, MetadataArrived, _P.ABSENT,
            guard=_S._guard_unopened_full, emits=[_DROPPED], action=_S._act_drop_unopened_full),
        row(_P.ABSENT, MetadataArrived, _P.PARKED, action=_S._act_park),
        row(_P.ABSENT, AbortArrived, _P.ABSENT,
            guard=_S._guard_unopened_full, emits=[_DROPPED], action=_S._act_drop_unopened_full),
        row(_P.ABSENT, AbortArrived, _P.CANCELLED, emits=[_ACK], action=_S._act_cancel),
        # -- PARKED: metadata waits for the engine to open this generation -----------------------
        row(_P.PARKED, OpenSlot, _P.OPEN, emits=[_DROPPED], action=_S._act_open),
        row(_P.PARKED, MetadataArrived, _P.PARKED,
            guard=_S._guard_parking_full, emits=[_DROPPED], action=_S._act_drop_parking_full),
        row(_P.PARKED, MetadataArrived, _P.PARKED, action=_S._act_park),
        row(_P.PARKED, AbortArrived, _P.CANCELLED, emits=[_ACK], action=_S._act_cancel),
        row(_P.PARKED, Tick, _P.ABSENT,
            guard=_S._guard_parking_expired, action=_S._act_forget_parked),
        # -- CANCELLED: ACKed before it opened; it fails at once if it ever opens ----------------
        row(_P.CANCELLED, OpenSlot, _P.OPEN, action=_S._act_open_cancelled),
        row(_P.CANCELLED, MetadataArrived, _P.CANCELLED,
            emits=[_DROPPED], action=_S._act_drop_cancelled),
        row(_P.CANCELLED, AbortArrived, _P.CANCELLED, emits=[_ACK], action=_S._act_ack_cancelled),
        # -- OPEN: the engine's room -----------------------------------------------------------
        row(_P.OPEN, MetadataArrived, _P.OPEN, action=_S._act_deliver_metadata),
        row(_P.OPEN, AbortArrived, _P.OPEN, action=_S._act_deliver_abort),
        row(_P.OPEN, ClearSlot, _P.DRAINING,
            guard=_S._guard_writes_in_flight, action=_S._act_start_draining),
        row(_P.OPEN, ClearSlot, _P.REMOVED,
            guard=_S._guard_room_terminal, emits=[_REMOVED], action=_S._act_remove),
        row(_P.OPEN, TransferCompleted, _P.OPEN, action=_S._act_deliver_write),
        # -- DRAINING: cleared by the engine, writes still in flight ---------------------------
        row(_P.DRAINING, MetadataArrived, _P.DRAINING, action=_S._act_deliver_metadata),
        row(_P.DRAINING, AbortArrived, _P.DRAINING, action=_S._act_deliver_abort),
        row(_P.DRAINING, TransferCompleted, _P.REMOVED,
            guard=_S._guard_drains_last_write, emits=[_REMOVED], action=_S._act_drain_and_remove),
        row(_P.DRAINING, TransferCompleted, _P.DRAINING, action=_S._act_deliver_write),
        # -- REMOVED: finished or skipped; its open is refused while the mark is kept -----------
        row(_P.REMOVED, MetadataArrived, _P.REMOVED, emits=[_DROPPED], action=_S._act_drop_stale),
        row(_P.REMOVED, AbortArrived, _P.REMOVED,
            guard=_S._guard_opened_mark, emits=[_ACK], action=_S._act_ack),
        row(_P.REMOVED, AbortArrived, _P.REMOVED,
            guard=_S._guard_unopened_full, emits=[_DROPPED], action=_S._act_drop_unopened_full),
        row(_P.REMOVED, AbortArrived, _P.REMOVED, emits=[_ACK], action=_S._act_ack_below_mark),
    ],
)  # fmt: skip
PrefillRoomSlot.table = PREFILL_SLOT_TABLE


def abort_ack_of(abort: Abort, me: PeerId) -> SendMessage:
    """The ACK of an abort, sent by this prefill rank."""
    ack = AbortAck(room=abort.room, generation=abort.generation, prefill=me, decode=abort.decode)
    return SendMessage(to=abort.decode, message=ack)
