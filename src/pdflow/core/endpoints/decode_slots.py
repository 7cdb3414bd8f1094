"""The decode endpoint's room slots: which generation of a room id a status or result belongs to.

A decode never parks: rooms are created only by the engine (``no_resurrection``), so a slot is
OPEN while the engine's room of that generation is open and ABSENT otherwise, and whatever
names another generation is dropped and counted. What a cleared room still holds (fenced
pages) lives in the page ledger, keyed by (room, generation), so the engine may open the room
id's next generation at once. Rows: ``[machines.DecodeRoomSlot]`` in spec/machines/room_slots.toml.
"""

from __future__ import annotations

import enum
from typing import Protocol

from pdflow.core.endpoints.endpoint_io import ChecksumChecked, Dropped, RoomRemoved
from pdflow.core.endpoints.room_host import REMOVED_ROOMS_COUNTER
from pdflow.core.endpoints.slot_inputs import CLEAR_HINT, ClearSlot, OpenSlot
from pdflow.core.framework.table import Table, TableMachine, row
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.messages import StatusReport
from pdflow.core.protocol.outputs import Output
from pdflow.core.rooms.receiver_room import ReceiverRoom


class DecodeSlotState(enum.Enum):
    ABSENT = "ABSENT"
    OPEN = "OPEN"


# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_ABSENT, _OPEN = DecodeSlotState.ABSENT, DecodeSlotState.OPEN


class StatusArrived(Input, frozen=True, tag="StatusArrived"):
    """A prefill rank's status report for this (room, generation)."""

    report: StatusReport


class DecodeSlotHost(Protocol):
    rooms: dict[int, ReceiverRoom]

    def host_receiver(self, room: int, generation: int, now: float) -> None: ...

    def deliver_status(self, room: ReceiverRoom, report: StatusReport, now: float) -> None: ...

    def deliver_checksum(self, room: ReceiverRoom, result: ChecksumChecked, now: float) -> None: ...

    def forget_receiver(self, room: ReceiverRoom, now: float) -> None: ...

    def releasing_after_verify(self, room: int, generation: int) -> bool: ...

    def verification_ended(self, room: int, generation: int, now: float) -> None: ...

    def count(self, counter: str) -> None: ...


class DecodeRoomSlot(TableMachine[DecodeSlotState]):
    """One (room id, generation) slot of a decode rank, read off the rooms it hosts."""

    table: Table[DecodeSlotState]

    def __init__(self, host: DecodeSlotHost, room: int, generation: int) -> None:
        self.host = host
        self.at(room, generation)

    def at(self, room: int, generation: int) -> DecodeRoomSlot:
        """Re-point this slot at (room, generation), its state read afresh off the hosted
        rooms: the endpoint keeps one slot and re-points it per input (nothing of a slot
        outlives its step), instead of building one per input."""
        self.key = room
        self.generation = generation
        hosted = self.host.rooms.get(room)
        opened = hosted is not None and hosted.generation == generation
        self.state = _OPEN if opened else _ABSENT
        return self

    def _room(self) -> ReceiverRoom:
        return self.host.rooms[self.key]

    # ---- guards --------------------------------------------------------------------------------
    def _guard_room_terminal(self, inp: ClearSlot, now: float) -> bool:
        return self._room().poll.is_terminal

    def _guard_releasing_after_verify(self, inp: ChecksumChecked, now: float) -> bool:
        return self.host.releasing_after_verify(self.key, self.generation)

    # ---- actions -------------------------------------------------------------------------------
    def _act_open(self, inp: OpenSlot, now: float) -> list[Output]:
        self.host.host_receiver(self.key, self.generation, now)
        return []

    def _act_deliver_status(self, inp: StatusArrived, now: float) -> list[Output]:
        self.host.deliver_status(self._room(), inp.report, now)
        return []

    def _act_deliver_checksum(self, inp: ChecksumChecked, now: float) -> list[Output]:
        self.host.deliver_checksum(self._room(), inp, now)
        return []

    def _act_end_verification(self, inp: ChecksumChecked, now: float) -> list[Output]:
        # The room was cleared while its verification ran: its pages waited for this answer.
        self.host.verification_ended(self.key, self.generation, now)
        return []

    def _act_remove(self, inp: ClearSlot, now: float) -> list[Output]:
        room = self.host.rooms.pop(self.key)
        self.host.forget_receiver(room, now)
        self.host.count(REMOVED_ROOMS_COUNTER[room.poll])
        return [RoomRemoved(room.key, room.generation)]

    def _act_drop_status(self, inp: StatusArrived, now: float) -> list[Output]:
        # A late status for a cleared room, or for another use of the room id: no effect.
        return [self._drop("unknown_room", "status")]

    def _drop(self, kind: str, what: str) -> Dropped:
        self.host.count(f"dropped_{kind}")
        return Dropped(kind, f"{what} for room {self.key}/{self.generation}, which is not open")


_D = DecodeSlotState
_S = DecodeRoomSlot

DECODE_SLOT_TABLE: Table[DecodeSlotState] = Table(
    machine="DecodeRoomSlot",
    states=DecodeSlotState,
    initial=DecodeSlotState.ABSENT,
    inputs=(OpenSlot, StatusArrived, ChecksumChecked, ClearSlot),
    remote_inputs=(StatusArrived,),
    hints={
        "OpenSlot": "the room id is already open with this generation",
        "ClearSlot": CLEAR_HINT,
        "ChecksumChecked": "report each VerifyChecksums exactly once, for the room instance it "
        "named",
    },
    rows=[
        row(_D.ABSENT, OpenSlot, _D.OPEN, action=_S._act_open),
        row(_D.ABSENT, StatusArrived, _D.ABSENT, emits=["dropped"], action=_S._act_drop_status),
        row(_D.ABSENT, ChecksumChecked, _D.ABSENT,
            guard=_S._guard_releasing_after_verify, action=_S._act_end_verification),
        row(_D.OPEN, StatusArrived, _D.OPEN, action=_S._act_deliver_status),
        row(_D.OPEN, ChecksumChecked, _D.OPEN, action=_S._act_deliver_checksum),
        row(_D.OPEN, ClearSlot, _D.ABSENT,
            guard=_S._guard_room_terminal, emits=["room_removed"], action=_S._act_remove),
    ],
)  # fmt: skip
DecodeRoomSlot.table = DECODE_SLOT_TABLE
