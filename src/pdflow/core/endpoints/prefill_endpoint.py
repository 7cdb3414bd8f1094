"""PrefillEndpoint: one prefill rank hosting many SenderRooms.

It routes every input to its room, keeps what arrives before the engine opens a room (metadata,
and aborts, so a cancel is never lost), drops stale messages (another incarnation, another
generation of the room id) with a counted reason, and removes a failed room only once its last
write has drained.
"""

from __future__ import annotations

import msgspec

from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ClearRoom,
    OpenRoom,
    PrefillEndpointConfig,
    Received,
    RoomCall,
    RoomRemoved,
    TimerFired,
)
from pdflow.core.endpoints.room_host import RoomHost
from pdflow.core.framework.deadlines import DeadlineQueue
from pdflow.core.framework.errors import LocalProtocolError, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.framework.table import Fired
from pdflow.core.protocol.inputs import (
    AbortArrived,
    AbortRequested,
    Input,
    MetadataArrived,
    PrefillCompleted,
    Tick,
    TransferCompleted,
)
from pdflow.core.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    AnyMessage,
    BootstrapRequest,
    RoomMetadata,
    StatusReport,
)
from pdflow.core.protocol.outputs import Output, SendMessage, StatusChanged
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.core.rooms.prefill_complete import (
    BootstrapArrived,
    ClaimRoom,
    CloseRoom,
    FailRoom,
    MarkComplete,
    OwnerRefused,
    PrefillCompleteTable,
)
from pdflow.core.rooms.sender_room import SenderRoom, SenderState


class EarlyArrivals(msgspec.Struct):
    """Messages for a (room, generation) the engine has not opened yet."""

    expires_at: float
    metadata: list[RoomMetadata] = msgspec.field(default_factory=list)
    aborts: list[Abort] = msgspec.field(default_factory=list)


class SenderSummary(msgspec.Struct, frozen=True):
    room: int
    generation: int
    state: str
    poll: KVPoll
    outstanding: int
    peers: int
    reason: str


class PrefillSnapshot(msgspec.Struct, frozen=True):
    me: str
    rooms: tuple[SenderSummary, ...]
    early: int
    counters: dict[str, int]


class PrefillEndpoint(RoomHost[SenderRoom]):
    open_hint = "OpenRoom first; a cleared room cannot be used again without OpenRoom"
    role = "prefill"

    def __init__(self, config: PrefillEndpointConfig) -> None:
        self.config = config
        super().__init__(config.me)
        self.early: dict[tuple[int, int], EarlyArrivals] = {}
        self.remove_when_drained: set[int] = set()
        self.early_deadlines: DeadlineQueue[tuple[int, int]] = DeadlineQueue()
        # Under prefill_complete the ready signal, and who may wait for it, live in this table.
        self.ready_table: PrefillCompleteTable | None = (
            PrefillCompleteTable(config.me, config.timeouts)
            if config.policy is AllocationPolicy.PREFILL_COMPLETE
            else None
        )

    # ---- the one entry point ---------------------------------------------------------------------
    def handle(self, inp: AnyEndpointInput, now: float) -> Step:
        outputs: list[Output] = []
        fired: list[Fired] = []
        if isinstance(inp, OpenRoom):
            self._open(inp, now, outputs, fired)
        elif isinstance(inp, RoomCall):
            room = self._known_room(inp.room)
            self._room_input(room, inp.call, now, outputs, fired)
            if isinstance(inp.call, PrefillCompleted):
                self._ready_table(MarkComplete(room.key, room.generation), now, outputs, fired)
        elif isinstance(inp, ClearRoom):
            self._clear(inp, now, outputs, fired)
        elif isinstance(inp, Received):
            self._receive(inp.message, now, outputs, fired)
        elif isinstance(inp, TransferCompleted):
            self._transfer_done(inp, now, outputs, fired)
        elif isinstance(inp, TimerFired):
            self._timers(now, outputs, fired)
        else:
            raise LocalProtocolError(
                f"a prefill endpoint does not take {type(inp).__name__}",
                hint="decode-side inputs go to a DecodeEndpoint",
            )
        return Step(tuple(outputs), self.timer_at(), tuple(fired))

    def timer_at(self) -> float | None:
        deadlines = [self.deadlines.next_deadline(), self.early_deadlines.next_deadline()]
        if self.ready_table is not None:
            deadlines.append(self.ready_table.timer_at())
        present = [d for d in deadlines if d is not None]
        return min(present) if present else None

    # ---- inputs ----------------------------------------------------------------------------------
    def _open(self, inp: OpenRoom, now: float, outputs: list[Output], fired: list[Fired]) -> None:
        self._refuse_duplicate(inp.room)
        # Claim first: a claim the ready table refuses with InvalidInput must change nothing.
        claim = self._ready_table(
            ClaimRoom(inp.room, inp.generation, inp.generation), now, outputs, fired
        )
        room = SenderRoom(
            inp.room, inp.generation, self.me, now,
            policy=self.config.policy, timeouts=self.config.timeouts,
        )  # fmt: skip
        self.rooms[inp.room] = room
        self._arm(room)
        refused = [o for o in claim if isinstance(o, OwnerRefused)]
        if refused:
            self._room_input(room, AbortRequested(refused[0].reason), now, outputs, fired)
        early = self.early.pop((inp.room, inp.generation), None)
        self.early_deadlines.arm((inp.room, inp.generation), None)
        for key in [k for k in self.early if k[0] == inp.room and k[1] < inp.generation]:
            # The engine moved on to a later generation: older cancels have nothing to guard.
            del self.early[key]
            self.early_deadlines.arm(key, None)
        if early is None:
            return
        for md in early.metadata:
            self._room_input(room, MetadataArrived(md), now, outputs, fired)
        for abort in early.aborts:
            self._room_input(room, AbortArrived(abort), now, outputs, fired)

    def _clear(
        self, inp: ClearRoom, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        room = self._known_room(inp.room)
        if room.state is SenderState.DRAINING:
            self.remove_when_drained.add(inp.room)
            return
        if not room.poll.is_terminal:
            raise LocalProtocolError(
                f"room {inp.room} is {room.poll.name}; only a terminal room can be cleared",
                hint="abort the room first (RoomCall with AbortRequested)",
            )
        self._remove(room, now, outputs, fired)

    def _ready_table(
        self, inp: Input, now: float, outputs: list[Output], fired: list[Fired]
    ) -> list[Output]:
        if self.ready_table is None:
            return []
        step = self.ready_table.handle(inp, now)
        outputs.extend(step.outputs)
        fired.extend(step.fired)
        return list(step.outputs)

    def _receive(
        self, message: AnyMessage, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        if isinstance(message, (StatusReport, AbortAck)):
            self._drop(outputs, "wrong_direction", f"{type(message).__name__} sent to a prefill")
            return
        if isinstance(message, (RoomMetadata, BootstrapRequest)) and (
            message.version != PROTOCOL_VERSION
        ):
            self._drop(outputs, "bad_version", f"protocol version {message.version}")
            return
        if message.prefill != self.me:
            self._drop(
                outputs, "stale_incarnation",
                f"{type(message).__name__} for {message.prefill.address}/"
                f"{message.prefill.incarnation} rank {message.prefill.rank}",
            )  # fmt: skip
            return
        if isinstance(message, BootstrapRequest):
            if self.ready_table is None:
                self._drop(outputs, "policy_mismatch", "BootstrapRequest under the early policy")
                return
            arrived = BootstrapArrived(message.room, message.generation, message.decode)
            try:
                self._ready_table(arrived, now, outputs, fired)
            except RemoteProtocolError as exc:
                self._drop(outputs, "protocol_error", str(exc))
            return
        room = self.rooms.get(message.room)
        if room is None or room.generation != message.generation:
            if room is not None and room.generation != message.generation:
                if isinstance(message, Abort):
                    outputs.append(self._ack(message))
                    return
                self._drop(outputs, "stale_generation", f"room {message.room}")
                return
            self._park(message, now, outputs, fired)
            return
        wrapped: Input = (
            MetadataArrived(message) if isinstance(message, RoomMetadata) else AbortArrived(message)
        )
        try:
            self._room_input(room, wrapped, now, outputs, fired)
        except RemoteProtocolError as exc:
            self._drop(outputs, "protocol_error", str(exc))

    def _park(
        self, message: RoomMetadata | Abort, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        key = (message.room, message.generation)
        entry = self.early.get(key)
        if entry is None:
            entry = EarlyArrivals(expires_at=now + self.config.timeouts.bootstrap_timeout)
            self.early[key] = entry
            self.early_deadlines.arm(key, entry.expires_at)
        if isinstance(message, Abort):
            # Nothing of an unopened room can be writing: ACK now. The ACK promises the decode
            # that this generation will never write, so the cancel is kept, with no expiry,
            # until the engine opens this generation (which then fails at once) or a later
            # one: a duplicate or late metadata must never revive it.
            entry.aborts.append(message)
            entry.metadata.clear()
            self.early_deadlines.arm(key, None)
            outputs.append(self._ack(message))
            self._ready_table(FailRoom(message.room, "aborted by decode"), now, outputs, fired)
        elif entry.aborts:
            self._drop(outputs, "aborted_room", f"metadata for cancelled room {key}")
        else:
            entry.metadata.append(message)

    def _transfer_done(
        self, inp: TransferCompleted, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        room = self._known_room(inp.room)
        if room.generation != inp.generation:
            raise LocalProtocolError(
                f"transfer completion for room {inp.room} generation {inp.generation}, "
                f"but the room is generation {room.generation}"
            )
        self._room_input(room, inp, now, outputs, fired)
        if inp.room in self.remove_when_drained and room.quiescent:
            self.remove_when_drained.discard(inp.room)
            self._remove(room, now, outputs, fired)

    def _timers(self, now: float, outputs: list[Output], fired: list[Fired]) -> None:
        ready_due = self.ready_table is not None and (self.ready_table.timer_at() or now + 1) <= now
        if ready_due:
            self._ready_table(Tick(), now, outputs, fired)
        for key in self.early_deadlines.pop_due(now):
            self.early.pop(key, None)
            self.counters["early_arrivals_expired"] += 1
        for room_id in self.deadlines.pop_due(now):
            room = self.rooms.get(room_id)
            if room is not None:
                self._room_input(room, Tick(), now, outputs, fired)

    # ---- helpers ---------------------------------------------------------------------------------
    def _room_input(
        self, room: SenderRoom, inp: Input, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        produced, transition = room.fire(inp, now)
        outputs.extend(produced)
        fired.append(transition)
        self._arm(room)
        failed = any(isinstance(o, StatusChanged) and o.poll is KVPoll.Failed for o in produced)
        if failed:
            self._ready_table(FailRoom(room.key, room.reason), now, outputs, fired)

    def _remove(
        self, room: SenderRoom, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        success = room.poll is KVPoll.Success
        self._ready_table(CloseRoom(room.key, room.generation, success), now, outputs, fired)
        del self.rooms[room.key]
        self.deadlines.arm(room.key, None)
        self.counters[f"rooms_{room.poll.name.lower()}"] += 1
        outputs.append(RoomRemoved(room.key, room.generation))

    def _ack(self, abort: Abort) -> SendMessage:
        return SendMessage(
            to=abort.decode,
            message=AbortAck(
                room=abort.room, generation=abort.generation, prefill=self.me, decode=abort.decode
            ),
        )

    # ---- read-only views -------------------------------------------------------------------------
    def clearable_rooms(self) -> tuple[int, ...]:
        """Terminal rooms the engine may clear now (one cleared while draining is waited for)."""
        return tuple(
            r for r in self.open_rooms()
            if self.rooms[r].poll.is_terminal and r not in self.remove_when_drained
        )  # fmt: skip

    def summary(self, room_id: int) -> SenderSummary | None:
        room = self.rooms.get(room_id)
        if room is None:
            return None
        return SenderSummary(
            room.key, room.generation, room.state.name, room.poll, len(room.outstanding),
            len(room.peers), room.reason,
        )  # fmt: skip

    def snapshot(self) -> PrefillSnapshot:
        summaries = tuple(s for s in (self.summary(r) for r in sorted(self.rooms)) if s is not None)
        return PrefillSnapshot(
            self.label,
            summaries,
            len(self.early),
            dict(sorted(self.counters.items())),
        )

    @property
    def outstanding_writes(self) -> int:
        return sum(len(room.outstanding) for room in self.rooms.values())
