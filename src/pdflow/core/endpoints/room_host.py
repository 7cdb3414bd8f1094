"""What both endpoints do with their rooms, written once: claim, look up, arm, drop, label."""

from __future__ import annotations

from collections import Counter
from typing import Any, Generic, TypeVar

from pdflow.core.endpoints.endpoint_io import Dropped
from pdflow.core.framework.deadlines import DeadlineQueue
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.table import TableMachine
from pdflow.core.protocol.messages import (
    PeerId,
    RoomMessage,
    generation_refusal,
    wire_int_refusal,
)
from pdflow.core.protocol.outputs import Output

R = TypeVar("R", bound=TableMachine[Any])

REMOVED_ROOMS_COUNTER = {poll: f"rooms_{poll.name.lower()}" for poll in KVPoll}
"""The counter a removed room adds one to, by its last KVPoll (each name built once)."""


class RoomHost(Generic[R]):
    """One rank's rooms by id, their deadlines and the rank's counters."""

    open_hint = "open the room first"
    """What the engine must call before using a room id (each endpoint names its own call)."""

    def __init__(self, me: PeerId) -> None:
        self.me = me
        self.rooms: dict[int, R] = {}
        self.deadlines: DeadlineQueue[int] = DeadlineQueue()
        self.counters: Counter[str] = Counter()

    # ---- read-only queries (what a shell may ask; it never reads the rooms themselves) -------
    def open_rooms(self) -> tuple[int, ...]:
        """The room ids open on this rank, in order."""
        return tuple(sorted(self.rooms))

    def is_open(self, room_id: int) -> bool:
        return room_id in self.rooms

    def generation_of(self, room_id: int) -> int | None:
        """The open room's generation; None when the room id is not open."""
        room = self.rooms.get(room_id)
        return None if room is None else int(room.generation)

    @property
    def label(self) -> str:
        return f"{self.me.address}/{self.me.incarnation}#{self.me.rank}"

    def _refuse_duplicate(self, room_id: int) -> None:
        existing = self.rooms.get(room_id)
        if existing is not None:
            raise LocalProtocolError(
                f"room {room_id} is already open (generation {existing.generation}, "
                f"{existing.state.name}); a duplicate claim fails",
                hint="fail this request; the router assigned a room id twice",
            )

    def _refuse_out_of_wire_range(self, room_id: int, generation: int) -> None:
        """An open must name a room id and a generation every message about it can carry."""
        refusal = wire_int_refusal("room id", room_id) or generation_refusal(generation)
        if refusal is not None:
            raise InvalidInput(f"cannot open a room: {refusal}")

    def _bad_generation(self, message: RoomMessage, outputs: list[Output]) -> bool:
        """Drop (and count) a peer's room message whose generation the protocol does not allow:
        no generation outside the range is ever opened, and the room id's records would take
        it for one (-2**63 reads as none)."""
        refusal = generation_refusal(message.generation)
        if refusal is not None:
            self._drop(outputs, "bad_generation", f"{type(message).__name__}: {refusal}")
        return refusal is not None

    def _known_room(self, room_id: int) -> R:
        room = self.rooms.get(room_id)
        if room is None:
            raise LocalProtocolError(
                f"room {room_id} is not open on {self.me.address}", hint=self.open_hint
            )
        return room

    def _arm(self, room: R) -> None:
        # One deadline per room id, the open room's: an older generation still draining (its
        # engine cleared it) has none, and arming for it would disarm the open one's.
        if self.rooms.get(room.key) is room:
            self.deadlines.arm(room.key, room.timer_at())

    def _drop(self, outputs: list[Output], kind: str, reason: str) -> None:
        self.counters[f"dropped_{kind}"] += 1
        outputs.append(Dropped(kind, reason))
