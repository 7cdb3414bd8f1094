"""PrefillCompleteTable: the prefill side of the ``prefill_complete`` allocation policy.

Under ``prefill_complete`` the decode reserves pages only after the prefill says it is ready
(a ``WaitingForInput`` status). Per room this table keeps who owns the room (the local sender),
which decode endpoint waits for the ready notice, and whether the room is ready or failed. It
makes four promises: at most one owner; at most one ready notice; at most one failure notice,
and a failure always beats a late ready; a cancel that arrives before the sender exists is kept
as a failed *tombstone*, so the sender that opens the room later fails at once. Rooms without an
owner (an early bootstrap, a tombstone) expire after ``waiting_timeout + bootstrap_timeout``.

Each room is a table machine (``[machines.PrefillComplete]`` in
spec/machines/prefill_complete.toml); the table routes inputs to them and forgets a room when
it returns to ``ABSENT``.
"""

from __future__ import annotations

import enum
from typing import cast

import msgspec

from pdflow.core.framework.errors import InvalidInput, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step, earliest
from pdflow.core.framework.table import Fired, Table, TableMachine, row
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.core.protocol.messages import PeerId, StatusReport
from pdflow.core.protocol.outputs import Output, SendMessage
from pdflow.core.protocol.policy import Timeouts

DUPLICATE_ROOM = "Duplicate or cancelled bootstrap room"


class BootstrapRoomState(enum.Enum):
    ABSENT = "ABSENT"
    UNOWNED = "UNOWNED"
    OWNED = "OWNED"
    READY = "READY"
    FAILED = "FAILED"
    TOMBSTONE = "TOMBSTONE"


# ---- inputs ------------------------------------------------------------------------------------
class ClaimRoom(Input, frozen=True, tag="ClaimRoom"):
    """A local sender claims the room. ``owner_id`` identifies that sender."""

    room: int
    generation: int
    owner_id: int


class BootstrapArrived(Input, frozen=True, tag="BootstrapArrived"):
    """A decode endpoint asks to be told when the room's prefill has finished."""

    room: int
    generation: int
    endpoint: PeerId


class MarkComplete(Input, frozen=True, tag="MarkComplete"):
    """The owner's prefill finished computing the room's KV."""

    room: int
    owner_id: int


class FailRoom(Input, frozen=True, tag="FailRoom"):
    """Any failure or ABORT of the room, possibly before its sender exists."""

    room: int
    reason: str = "failed on the prefill"


class CloseRoom(Input, frozen=True, tag="CloseRoom"):
    """The owner is done with the room: deleted on success, kept as a tombstone on failure."""

    room: int
    owner_id: int
    success: bool


# ---- outputs -----------------------------------------------------------------------------------
class OwnerRefused(Output, frozen=True, tag="owner_refused"):
    """The sender that tried to open the room must fail: the room is taken or cancelled."""

    room: int
    owner_id: int
    reason: str


# ---- observable state ----------------------------------------------------------------------
class BootstrapRoomSnapshot(msgspec.Struct, frozen=True):
    room: int
    state: str
    generation: int | None
    owner: int | None
    endpoint: PeerId | None
    ready_notified: bool
    failure_notified: bool
    expires_at: float | None
    reason: str


class PrefillCompleteSnapshot(msgspec.Struct, frozen=True):
    ttl_s: float
    rooms: tuple[BootstrapRoomSnapshot, ...]


_B = BootstrapRoomState
_NOTICE = "send.status"
_REFUSED = "owner_refused"

PREFILL_COMPLETE_TABLE: Table[BootstrapRoomState] = Table(
    machine="PrefillComplete",
    states=BootstrapRoomState,
    initial=BootstrapRoomState.ABSENT,
    inputs=(ClaimRoom, BootstrapArrived, MarkComplete, FailRoom, CloseRoom, Tick),
    remote_inputs=(BootstrapArrived,),
    rows=[
        # -- ABSENT: no record of the room ------------------------------------------------------
        row(_B.ABSENT, ClaimRoom, _B.OWNED, action="open"),
        row(_B.ABSENT, BootstrapArrived, _B.UNOWNED, action="register_unowned"),
        row(_B.ABSENT, MarkComplete, _B.ABSENT),  # not the owner of anything: ignored
        row(_B.ABSENT, FailRoom, _B.TOMBSTONE, action="entomb"),  # cancel before the sender
        row(_B.ABSENT, CloseRoom, _B.ABSENT),
        # -- UNOWNED: a decode endpoint waits; no sender yet ------------------------------------
        row(_B.UNOWNED, ClaimRoom, _B.OWNED, action="open"),
        row(_B.UNOWNED, BootstrapArrived, _B.UNOWNED, guard="same_endpoint"),
        row(_B.UNOWNED, BootstrapArrived, _B.UNOWNED,
            emits=[_NOTICE], action="refuse_endpoint"),
        row(_B.UNOWNED, MarkComplete, _B.UNOWNED),
        row(_B.UNOWNED, FailRoom, _B.TOMBSTONE, emits=[_NOTICE], action="entomb"),
        row(_B.UNOWNED, CloseRoom, _B.UNOWNED),
        row(_B.UNOWNED, Tick, _B.ABSENT, guard="expired", action="forget"),
        row(_B.UNOWNED, Tick, _B.UNOWNED),
        # -- OWNED: the sender computes -----------------------------------------------------------
        row(_B.OWNED, ClaimRoom, _B.OWNED, emits=[_REFUSED], action="refuse_owner"),
        row(_B.OWNED, BootstrapArrived, _B.OWNED, guard="no_endpoint_yet", action="register"),
        row(_B.OWNED, BootstrapArrived, _B.OWNED, guard="same_endpoint"),
        row(_B.OWNED, BootstrapArrived, _B.OWNED, emits=[_NOTICE], action="refuse_endpoint"),
        row(_B.OWNED, MarkComplete, _B.OWNED, guard="foreign_owner"),
        row(_B.OWNED, MarkComplete, _B.READY, emits=[_NOTICE], action="complete"),
        row(_B.OWNED, FailRoom, _B.FAILED, emits=[_NOTICE], action="fail"),
        row(_B.OWNED, CloseRoom, _B.OWNED, guard="foreign_owner"),
        row(_B.OWNED, CloseRoom, _B.ABSENT, guard="succeeded", action="forget"),
        row(_B.OWNED, CloseRoom, _B.TOMBSTONE, emits=[_NOTICE], action="entomb"),
        row(_B.OWNED, Tick, _B.OWNED),
        # -- READY: the prefill finished; the ready notice went out (or waits for the endpoint) --
        row(_B.READY, ClaimRoom, _B.READY, emits=[_REFUSED], action="refuse_owner"),
        row(_B.READY, BootstrapArrived, _B.READY,
            guard="no_endpoint_yet", emits=[_NOTICE], action="register_and_notify"),
        row(_B.READY, BootstrapArrived, _B.READY, guard="same_endpoint"),
        row(_B.READY, BootstrapArrived, _B.READY, emits=[_NOTICE], action="refuse_endpoint"),
        row(_B.READY, MarkComplete, _B.READY),  # never a second ready notice
        row(_B.READY, FailRoom, _B.FAILED, emits=[_NOTICE], action="fail"),
        row(_B.READY, CloseRoom, _B.READY, guard="foreign_owner"),
        row(_B.READY, CloseRoom, _B.ABSENT, guard="succeeded", action="forget"),
        row(_B.READY, CloseRoom, _B.TOMBSTONE, emits=[_NOTICE], action="entomb"),
        row(_B.READY, Tick, _B.READY),
        # -- FAILED: failed while the owner still holds it --------------------------------------
        row(_B.FAILED, ClaimRoom, _B.FAILED, emits=[_REFUSED], action="refuse_owner"),
        row(_B.FAILED, BootstrapArrived, _B.FAILED,
            guard="no_endpoint_yet", emits=[_NOTICE], action="register_and_notify"),
        row(_B.FAILED, BootstrapArrived, _B.FAILED, guard="same_endpoint"),
        row(_B.FAILED, BootstrapArrived, _B.FAILED, emits=[_NOTICE], action="refuse_endpoint"),
        row(_B.FAILED, MarkComplete, _B.FAILED),  # failure beats a late ready
        row(_B.FAILED, FailRoom, _B.FAILED),
        row(_B.FAILED, CloseRoom, _B.FAILED, guard="foreign_owner"),
        row(_B.FAILED, CloseRoom, _B.TOMBSTONE, action="bury"),
        row(_B.FAILED, Tick, _B.FAILED),
        # -- TOMBSTONE: failed and ownerless, kept until it expires -----------------------------
        row(_B.TOMBSTONE, ClaimRoom, _B.TOMBSTONE, emits=[_REFUSED], action="refuse_owner"),
        row(_B.TOMBSTONE, BootstrapArrived, _B.TOMBSTONE,
            guard="no_endpoint_yet", emits=[_NOTICE], action="register_and_notify"),
        row(_B.TOMBSTONE, BootstrapArrived, _B.TOMBSTONE, guard="same_endpoint"),
        row(_B.TOMBSTONE, BootstrapArrived, _B.TOMBSTONE,
            emits=[_NOTICE], action="refuse_endpoint"),
        row(_B.TOMBSTONE, MarkComplete, _B.TOMBSTONE),
        row(_B.TOMBSTONE, FailRoom, _B.TOMBSTONE),
        row(_B.TOMBSTONE, CloseRoom, _B.TOMBSTONE),
        row(_B.TOMBSTONE, Tick, _B.ABSENT, guard="expired", action="forget"),
        row(_B.TOMBSTONE, Tick, _B.TOMBSTONE),
    ],
)  # fmt: skip

_FAILED_STATES = (BootstrapRoomState.FAILED, BootstrapRoomState.TOMBSTONE)


class BootstrapRoom(TableMachine[BootstrapRoomState]):
    """One room of the table: ``{owner, endpoint, ready, notified, failed, expires_at}``."""

    table = PREFILL_COMPLETE_TABLE

    def __init__(self, room: int, me: PeerId, ttl_s: float) -> None:
        self.key = room
        self.me = me
        self.ttl_s = ttl_s
        self.state = PREFILL_COMPLETE_TABLE.initial
        self.room_generation: int | None = None
        self.owner: int | None = None
        self.endpoint: PeerId | None = None
        self.ready_notified = False
        self.failure_notified = False
        self.expires_at: float | None = None
        self.reason = ""

    def snapshot(self) -> BootstrapRoomSnapshot:
        return BootstrapRoomSnapshot(
            room=self.key,
            state=self.state.name,
            generation=self.room_generation,
            owner=self.owner,
            endpoint=self.endpoint,
            ready_notified=self.ready_notified,
            failure_notified=self.failure_notified,
            expires_at=self.expires_at,
            reason=self.reason,
        )

    # ---- validation ----------------------------------------------------------------------------
    def _validate(self, inp: Input, now: float) -> None:
        if isinstance(inp, Tick):
            return
        keyed = cast(ClaimRoom | BootstrapArrived | MarkComplete | FailRoom | CloseRoom, inp)
        if keyed.room != self.key:
            raise InvalidInput(f"input for room {keyed.room} routed to room {self.key}")
        known = self.room_generation
        if isinstance(inp, BootstrapArrived) and known is not None and inp.generation != known:
            raise RemoteProtocolError(
                f"bootstrap for room {inp.room} generation {inp.generation}, but the room is at "
                f"generation {known}",
                hint="a stale decode request; drop it",
            )
        if (
            isinstance(inp, ClaimRoom)
            and self.state is BootstrapRoomState.UNOWNED
            and inp.generation != known
        ):
            raise InvalidInput(
                f"room {inp.room}: opening generation {inp.generation} but the waiting decode "
                f"endpoint asked for generation {known}; fail the request or reopen with {known}"
            )

    # ---- guards --------------------------------------------------------------------------------
    def _guard_same_endpoint(self, inp: Input, now: float) -> bool:
        return cast(BootstrapArrived, inp).endpoint == self.endpoint

    def _guard_no_endpoint_yet(self, inp: Input, now: float) -> bool:
        return self.endpoint is None

    def _guard_foreign_owner(self, inp: Input, now: float) -> bool:
        return cast(MarkComplete | CloseRoom, inp).owner_id != self.owner

    def _guard_succeeded(self, inp: Input, now: float) -> bool:
        return cast(CloseRoom, inp).success

    def _guard_expired(self, inp: Input, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    # ---- actions -------------------------------------------------------------------------------
    def _act_open(self, inp: Input, now: float) -> list[Output]:
        claim = cast(ClaimRoom, inp)
        self.owner = claim.owner_id
        self.room_generation = claim.generation
        self.expires_at = None  # an owned room lives as long as its owner
        return []

    def _act_refuse_owner(self, inp: Input, now: float) -> list[Output]:
        claim = cast(ClaimRoom, inp)
        return [OwnerRefused(claim.room, claim.owner_id, DUPLICATE_ROOM)]

    def _act_register(self, inp: Input, now: float) -> list[Output]:
        bootstrap = cast(BootstrapArrived, inp)
        self.endpoint = bootstrap.endpoint
        self.room_generation = bootstrap.generation
        return []

    def _act_register_unowned(self, inp: Input, now: float) -> list[Output]:
        self.expires_at = now + self.ttl_s
        return self._act_register(inp, now)

    def _act_register_and_notify(self, inp: Input, now: float) -> list[Output]:
        self._act_register(inp, now)
        if self.state is BootstrapRoomState.READY:
            return self._notify_ready()
        return self._notify_failure()

    def _act_refuse_endpoint(self, inp: Input, now: float) -> list[Output]:
        other = cast(BootstrapArrived, inp)
        reason = (
            f"room {other.room} is already bound to decode endpoint "
            f"{cast(PeerId, self.endpoint).address}"
        )
        return [self._notice(other.endpoint, other.generation, KVPoll.Failed, reason)]

    def _act_complete(self, inp: Input, now: float) -> list[Output]:
        return self._notify_ready()

    def _act_fail(self, inp: Input, now: float) -> list[Output]:
        self.reason = inp.reason if isinstance(inp, FailRoom) else "the owner closed it unfinished"
        return self._notify_failure()

    def _act_bury(self, inp: Input, now: float) -> list[Output]:
        self.owner = None
        self.expires_at = now + self.ttl_s
        return []

    def _act_entomb(self, inp: Input, now: float) -> list[Output]:
        outputs = self._act_fail(inp, now)
        self._act_bury(inp, now)
        return outputs

    def _act_forget(self, inp: Input, now: float) -> list[Output]:
        self.owner = None
        self.expires_at = None
        return []

    # ---- helpers -------------------------------------------------------------------------------
    def _notify_ready(self) -> list[Output]:
        if self.endpoint is None or self.ready_notified:
            return []
        self.ready_notified = True
        return [self._notice(self.endpoint, self._generation(), KVPoll.WaitingForInput, "")]

    def _notify_failure(self) -> list[Output]:
        if self.endpoint is None or self.failure_notified:
            return []
        self.failure_notified = True
        return [self._notice(self.endpoint, self._generation(), KVPoll.Failed, self.reason)]

    def _generation(self) -> int:
        # A notice goes only to a registered endpoint, and registering records the generation.
        return cast(int, self.room_generation)

    def _notice(
        self, endpoint: PeerId, generation: int, status: KVPoll, reason: str
    ) -> SendMessage:
        report = StatusReport(
            room=self.key,
            generation=generation,
            status=status,
            prefill=self.me,
            decode=endpoint,
            reason=reason,
        )
        return SendMessage(to=endpoint, message=report)


class PrefillCompleteTable:
    """Every ``prefill_complete`` room of one prefill rank. Drive it with :meth:`handle`."""

    def __init__(self, me: PeerId, timeouts: Timeouts = Timeouts()) -> None:  # noqa: B008
        self.me = me
        self.ttl_s = timeouts.waiting_timeout + timeouts.bootstrap_timeout
        self._rooms: dict[int, BootstrapRoom] = {}

    def state_of(self, room: int) -> BootstrapRoomState:
        held = self._rooms.get(room)
        return held.state if held is not None else BootstrapRoomState.ABSENT

    def is_failed(self, room: int) -> bool:
        return self.state_of(room) in _FAILED_STATES

    def timer_at(self) -> float | None:
        return earliest(*(r.expires_at for r in self._rooms.values()))

    def snapshot(self) -> PrefillCompleteSnapshot:
        rooms = tuple(self._rooms[key].snapshot() for key in sorted(self._rooms))
        return PrefillCompleteSnapshot(self.ttl_s, rooms)

    def handle(self, inp: Input, now: float) -> Step:
        if isinstance(inp, Tick):
            return self._sweep(inp, now)
        if not isinstance(inp, (ClaimRoom, BootstrapArrived, MarkComplete, FailRoom, CloseRoom)):
            raise InvalidInput(f"PrefillCompleteTable does not take {type(inp).__name__}")
        machine = self._rooms.get(inp.room) or BootstrapRoom(inp.room, self.me, self.ttl_s)
        outputs, fired = machine.fire(inp, now)
        self._keep_or_forget(machine)
        return Step(tuple(outputs), self.timer_at(), (fired,))

    def _sweep(self, tick: Tick, now: float) -> Step:
        fired: list[Fired] = []
        due = [r for r in self._rooms.values() if r.expires_at is not None and now >= r.expires_at]
        for machine in due:
            _, one = machine.fire(tick, now)
            fired.append(one)
            self._keep_or_forget(machine)
        return Step((), self.timer_at(), tuple(fired))

    def _keep_or_forget(self, machine: BootstrapRoom) -> None:
        if machine.state is BootstrapRoomState.ABSENT:
            self._rooms.pop(machine.key, None)
        else:
            self._rooms[machine.key] = machine
