"""PrefillEndpoint: one prefill rank hosting many SenderRooms.

It drops messages of another incarnation and hands everything else to the room slots
(prefill_slots.py): the table that decides which generation of a room id a message or call
belongs to, parks what arrives before the engine opens a generation, keeps a cancel that came
first, and removes a cleared room only once its last write has drained.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ClearRoom,
    Dropped,
    OpenRoom,
    PrefillEndpointConfig,
    Received,
    RoomCall,
    TimerFired,
)
from pdflow.core.endpoints.opened_marks import NONE, OpenedMarks
from pdflow.core.endpoints.prefill_slots import (
    PendingRecord,
    PrefillRoomSlot,
    abort_ack_of,
)
from pdflow.core.endpoints.room_host import RoomHost
from pdflow.core.endpoints.slot_inputs import ClearSlot, OpenSlot
from pdflow.core.framework.deadlines import DeadlineQueue
from pdflow.core.framework.dispatch import listed_kind
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
    KvArgs,
    KvArgsAccepted,
    PeerId,
    RoomMetadata,
    StatusReport,
)
from pdflow.core.protocol.outputs import Output, SendMessage, StatusChanged
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.core.resources.kv_layouts import DecodeLayouts
from pdflow.core.rooms.prefill_complete import (
    BootstrapArrived,
    ClaimRoom,
    CloseRoom,
    FailRoom,
    MarkComplete,
    OwnerRefused,
    PrefillCompleteTable,
)
from pdflow.core.rooms.sender_room import SenderRoom

# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_POLL_SUCCESS = KVPoll.Success
_POLL_FAILED = KVPoll.Failed
_PREFILL_INPUTS: frozenset[type] = frozenset(
    {RoomCall, TransferCompleted, Received, OpenRoom, ClearRoom, TimerFired}
)


class SenderSummary(msgspec.Struct, frozen=True):
    room: int
    generation: int
    state: str
    poll: KVPoll
    outstanding: int
    peers: int
    reason: str
    decode_prefix_len: int = 0
    """Tokens of the sequence the decode already holds; send only the pages after them."""


class PrefillSnapshot(msgspec.Struct, frozen=True):
    me: str
    rooms: tuple[SenderSummary, ...]
    draining: tuple[SenderSummary, ...]
    """Rooms the engine cleared while their writes were in flight."""
    pending: int
    """Room ids holding parked metadata or a cancel for a generation not opened yet."""
    counters: dict[str, int]
    decode_layouts: int = 0


class PrefillEndpoint(RoomHost[SenderRoom]):
    open_hint = (
        "open it first (PrefillRank.open_room, the core's OpenRoom); a cleared room id needs "
        "a new open"
    )
    role = "prefill"

    def __init__(self, config: PrefillEndpointConfig) -> None:
        self.config = config
        super().__init__(config.me)
        # The room slots (prefill_slots.py): what is kept per room id besides open rooms.
        self.draining: dict[tuple[int, int], SenderRoom] = {}
        self._draining_generations: Counter[int] = Counter()
        """Per room id, how many of its generations drain (asked per open: no walk over all)."""
        self.opened = OpenedMarks(config.max_finished_room_ids, self._holds_room_id)
        self.pending: dict[int, PendingRecord] = {}
        self.parking_deadlines: DeadlineQueue[int] = DeadlineQueue()
        self.bootstrap_timeout = config.timeouts.bootstrap_timeout
        self.max_pending_room_ids = config.max_pending_room_ids
        self.max_parked_peers = config.max_parked_peers
        self._step_outputs: list[Output] = []
        self._step_fired: list[Fired] = []
        self.layouts = DecodeLayouts(config.me, config.session_id, config.max_decode_layouts,
                                     config.max_layout_bytes)  # fmt: skip
        # Under prefill_complete the ready signal, and who may wait for it, live in this table.
        self.ready_table: PrefillCompleteTable | None = (
            PrefillCompleteTable(config.me, config.timeouts, config.max_ownerless_ready_rooms)
            if config.policy is AllocationPolicy.PREFILL_COMPLETE
            else None
        )
        # The one room slot, re-pointed per input: slots never nest (no slot rule fires
        # another slot input), and each input reads the slot's state afresh.
        self._slot_machine = PrefillRoomSlot(self, NONE, NONE)

    # ---- the one entry point ---------------------------------------------------------------------
    def handle(self, inp: AnyEndpointInput, now: float) -> Step:
        outputs: list[Output] = []
        fired: list[Fired] = []
        # The slots' actions add the effects of the rooms they drive to this step's lists.
        self._step_outputs, self._step_fired = outputs, fired
        # The input types are unrelated: the order only puts the most frequent first (a room
        # takes three or more calls and a write completion per chunk, one of everything else).
        # Compared by type with ``is`` (framework/dispatch.py).
        kind = type(inp)
        if kind not in _PREFILL_INPUTS:
            kind = listed_kind(inp, _PREFILL_INPUTS)
        given: Any = inp  # typed again in each branch: ``kind is X`` does not narrow ``inp``
        if kind is RoomCall:
            call: RoomCall = given
            room = self.rooms.get(call.room) or self._known_room(call.room)  # (raises if not)
            self.room_input(room, call.call, now)
            if isinstance(call.call, PrefillCompleted):
                done = MarkComplete(room.key, room.generation, room.generation)
                self._ready_table(done, now, outputs, fired)
        elif kind is TransferCompleted:
            completed: TransferCompleted = given
            self._slot(completed.room, completed.generation, completed, now)
        elif kind is Received:
            received: Received = given
            self._receive(received.message, now, outputs, fired)
        elif kind is OpenRoom:
            self._open(given, now, outputs, fired)
        elif kind is ClearRoom:
            self._clear(given, now, outputs, fired)
        elif kind is TimerFired:
            self._timers(now, outputs, fired)
        else:
            raise LocalProtocolError(
                f"a prefill endpoint does not take {type(inp).__name__}",
                hint="decode-side inputs go to a DecodeEndpoint",
            )
        return Step(tuple(outputs), self.timer_at(), tuple(fired))

    def timer_at(self) -> float | None:
        # Called once per step: no lists, no generator (most of the time only rooms are armed).
        earliest = self.deadlines.earliest
        parking = self.parking_deadlines.earliest
        if parking is not None and (earliest is None or parking < earliest):
            earliest = parking
        if self.ready_table is not None:
            ready = self.ready_table.timer_at()
            if ready is not None and (earliest is None or ready < earliest):
                earliest = ready
        return earliest

    # ---- inputs ----------------------------------------------------------------------------------
    def _open(self, inp: OpenRoom, now: float, outputs: list[Output], fired: list[Fired]) -> None:
        self._refuse_out_of_wire_range(inp.room, inp.generation)
        self._refuse_duplicate(inp.room)
        self._slot(inp.room, inp.generation, OpenSlot(inp.room, inp.generation), now)

    def _clear(self, inp: ClearRoom, now: float, outputs: list[Output], fired: list[Fired]) -> None:
        room = self._known_room(inp.room)
        self._slot(inp.room, room.generation, ClearSlot(inp.room, room.generation), now)

    def _slot(self, room: int, generation: int, inp: Input, now: float) -> None:
        """Fire one input into the (room, generation) slot; it routes it on."""
        outputs, fired = self._step_outputs, self._step_fired
        produced, transition = self._slot_machine.at(room, generation).step(inp, now)
        outputs.extend(produced)
        fired.append(transition)

    def _ready_table(
        self, inp: Input, now: float, outputs: list[Output], fired: list[Fired]
    ) -> list[Output]:
        if self.ready_table is None:
            return []
        step = self.ready_table.handle(inp, now)
        outputs.extend(step.outputs)
        fired.extend(step.fired)
        for output in step.outputs:
            if isinstance(output, Dropped):
                self.counters[f"dropped_{output.kind}"] += 1
        return list(step.outputs)

    def _receive(
        self, message: AnyMessage, now: float, outputs: list[Output], fired: list[Fired]
    ) -> None:
        if isinstance(message, (StatusReport, AbortAck, KvArgsAccepted)):
            self._drop(outputs, "wrong_direction", f"{type(message).__name__} sent to a prefill")
            return
        if isinstance(message, (RoomMetadata, BootstrapRequest)) and (
            message.version != PROTOCOL_VERSION
        ):
            self._drop(outputs, "bad_version", f"protocol version {message.version}")
            return
        if not isinstance(message, KvArgs) and self._bad_generation(message, outputs):
            return
        if message.prefill != self.me:
            self._drop(
                outputs, "stale_incarnation",
                f"{type(message).__name__} for {message.prefill.address}/"
                f"{message.prefill.incarnation} rank {message.prefill.rank}",
            )  # fmt: skip
            return
        if isinstance(message, KvArgs):
            produced, transitions = self.layouts.announce(message, now)
            outputs.extend(produced)
            fired.extend(transitions)
            for output in produced:
                if isinstance(output, Dropped):
                    self.counters[f"dropped_{output.kind}"] += 1
            if len(transitions) > 1:
                self.counters["decode_layouts_evicted"] += len(transitions) - 1
            return
        self.layouts.heard_from(message.decode)
        if isinstance(message, BootstrapRequest):
            if self.ready_table is None:
                self._drop(outputs, "policy_mismatch", "BootstrapRequest under the early policy")
                return
            arrived = BootstrapArrived(message.room, message.generation, message.decode)
            self._ready_table(arrived, now, outputs, fired)
            return
        wrapped: Input = (
            MetadataArrived(message) if isinstance(message, RoomMetadata) else AbortArrived(message)
        )
        try:
            self._slot(message.room, message.generation, wrapped, now)
        except RemoteProtocolError as exc:
            self._drop(outputs, "protocol_error", str(exc))

    def _timers(self, now: float, outputs: list[Output], fired: list[Fired]) -> None:
        ready_at = None if self.ready_table is None else self.ready_table.timer_at()
        if ready_at is not None and ready_at <= now:
            self._ready_table(Tick(), now, outputs, fired)
        for room_id in self.parking_deadlines.pop_due(now):
            record = self.pending.get(room_id)
            if record is not None and record.parked_generation != NONE:
                self._slot(room_id, record.parked_generation, Tick(), now)
        for room_id in self.deadlines.pop_due(now):
            room = self.rooms.get(room_id)
            if room is not None:
                self.room_input(room, Tick(), now)

    # ---- helpers ---------------------------------------------------------------------------------
    def room_input(self, room: SenderRoom, inp: Input, now: float) -> None:
        """Fire one input into a hosted room; its effects go to this step's lists."""
        produced, transition = room.fire(inp, now)
        outputs = self._step_outputs
        outputs.extend(produced)
        self._step_fired.append(transition)
        # RoomHost._arm, inlined (once or twice per step): only the open room has a deadline.
        # Most steps disarm a key that is not armed: that call is skipped (it does nothing).
        key = room.key
        if self.rooms.get(key) is room:
            deadline, deadlines = room.timer_at(), self.deadlines
            if deadline is not None or key in deadlines.armed:
                deadlines.arm(key, deadline)
        # Only a room that is Failed now can have reported Failed in this step (and only a
        # step with outputs can have reported anything).
        failed = (
            bool(produced)
            and room.poll is _POLL_FAILED
            and any(isinstance(o, StatusChanged) and o.poll is _POLL_FAILED for o in produced)
        )
        if failed:
            fail = FailRoom(room.key, room.generation, room.reason)
            self._ready_table(fail, now, outputs, self._step_fired)

    # ---- what the room slots ask of their endpoint (SlotHost) ----------------------------------
    def host_sender(self, room: int, generation: int, now: float) -> SenderRoom:
        """Host a new sender; under prefill_complete it first claims the bootstrap room."""
        outputs, fired = self._step_outputs, self._step_fired
        refused: list[OwnerRefused] = []
        if self.ready_table is not None:  # (no claim built under the early policy)
            claim = self._ready_table(ClaimRoom(room, generation, generation), now, outputs, fired)
            refused = [o for o in claim if isinstance(o, OwnerRefused)]
        sender = SenderRoom(
            room, generation, self.me, now,
            policy=self.config.policy, timeouts=self.config.timeouts,
        )  # fmt: skip
        self.rooms[room] = sender
        self._arm(sender)
        if refused:
            self.room_input(sender, AbortRequested(refused[0].reason), now)
        return sender

    def fail_unopened(self, room: int, generation: int, reason: str, now: float) -> None:
        fail = FailRoom(room, generation, reason)
        self._ready_table(fail, now, self._step_outputs, self._step_fired)

    def hold_draining(self, room: SenderRoom) -> None:
        """The engine cleared the room while its writes are in flight: held until they drain."""
        self.draining[(room.key, room.generation)] = room
        self._draining_generations[room.key] += 1

    def release_drained(self, room: SenderRoom) -> None:
        """The room's last write completed: it is no longer held."""
        del self.draining[(room.key, room.generation)]
        self._draining_generations[room.key] -= 1
        if not self._draining_generations[room.key]:
            del self._draining_generations[room.key]

    def close_sender(self, room: SenderRoom, now: float) -> None:
        """The engine is done with the sender: its deadline goes, the ready table closes it."""
        self.deadlines.arm(room.key, None)
        if self.ready_table is not None:  # (nothing to close under the early policy)
            success = room.poll is _POLL_SUCCESS
            close = CloseRoom(room.key, room.generation, room.generation, success)
            self._ready_table(close, now, self._step_outputs, self._step_fired)

    def count(self, counter: str) -> None:
        self.counters[counter] += 1

    def ack(self, abort: Abort) -> SendMessage:
        return abort_ack_of(abort, self.me)

    # ---- read-only views -------------------------------------------------------------------------
    def layout_of(self, decode: PeerId) -> KvArgs | None:
        """The KV layout this decode rank life announced (None: not announced, or evicted)."""
        return self.layouts.layout_of(decode)

    def clearable_rooms(self) -> tuple[int, ...]:
        """Terminal rooms the engine may clear now (one it cleared that still drains is no
        longer open: the endpoint holds it out of the engine's view)."""
        return tuple(r for r in self.open_rooms() if self.rooms[r].poll.is_terminal)

    def _holds_room_id(self, room_id: int) -> bool:
        """Whether anything of the room id is held: its opened mark must then be kept."""
        return (
            room_id in self.rooms
            or room_id in self.pending
            or room_id in self._draining_generations
        )

    def is_draining(self, room_id: int, generation: int) -> bool:
        """The engine cleared this generation while its writes were in flight; they still are."""
        return (room_id, generation) in self.draining

    def summary(self, room_id: int) -> SenderSummary | None:
        room = self.rooms.get(room_id)
        return None if room is None else self._summary(room)

    def _summary(self, room: SenderRoom) -> SenderSummary:
        return SenderSummary(
            room.key, room.generation, room.state.name, room.poll, len(room.outstanding),
            len(room.peers), room.reason, room.decode_prefix_len,
        )  # fmt: skip

    def snapshot(self) -> PrefillSnapshot:
        summaries = tuple(s for s in (self.summary(r) for r in sorted(self.rooms)) if s is not None)
        draining = tuple(self._summary(self.draining[key]) for key in sorted(self.draining))
        return PrefillSnapshot(
            self.label,
            summaries,
            draining,
            len(self.pending),
            dict(sorted(self.counters.items())),
            len(self.layouts),
        )

    @property
    def outstanding_writes(self) -> int:
        hosted = [*self.rooms.values(), *self.draining.values()]
        return sum(len(room.outstanding) for room in hosted)
