"""PrefillCompleteTable: the prefill side of the ``prefill_complete`` allocation policy.

Under ``prefill_complete`` the decode reserves pages only after the prefill says it is ready
(a ``WaitingForInput`` status). Per (room, generation) this table keeps who owns the room (the
local sender), which decode endpoint waits for the ready notice, and whether it is ready or
failed. It
makes four promises: at most one owner; at most one ready notice; at most one failure notice,
and a failure always beats a late ready; a cancel that arrives before the sender exists is kept
as a failed *tombstone*, so the sender that opens the room later fails at once. Rooms without an
owner (an early bootstrap, a tombstone) expire after ``waiting_timeout + bootstrap_timeout``,
or as soon as a later generation of the room id arrives (they are superseded): so a failed
generation never blocks the next one, and a room id holds at most a few entries. The table holds
at most ``max_ownerless`` ownerless entries in all, else stray or forged bootstraps for room ids no
engine opens would each be held for the whole TTL. An entry past the cap first evicts the oldest
tombstone: a failure fact nearest its expiry is worth less than a live room's bootstrap, which
dropped would leave its decode waiting out its timeout. Only when every ownerless entry is a
decode still waiting is an entry a peer's BootstrapRequest or an unopened room's cancel would
create dropped (``ready_table_full``), and an owner closing its room unfinished keeps no tombstone.

Each room is a table machine (``[machines.PrefillComplete]`` in
spec/machines/prefill_complete.toml); the table routes inputs to them and forgets a room when
it returns to ``ABSENT``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from pdflow.core.endpoints.endpoint_io import Dropped
from pdflow.core.framework.deadlines import DeadlineQueue
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.framework.table import Fired, Table, TableMachine, row
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.core.protocol.messages import PeerId, StatusReport
from pdflow.core.protocol.outputs import Output, SendMessage
from pdflow.core.protocol.policy import Timeouts

DUPLICATE_ROOM = "Duplicate or cancelled bootstrap room"
TABLE_FULL = "ready_table_full"
"""The Dropped kind of an input that would create an ownerless entry past the table's cap."""


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
    generation: int
    owner_id: int


class FailRoom(Input, frozen=True, tag="FailRoom"):
    """Any failure or ABORT of the room, possibly before its sender exists."""

    room: int
    generation: int
    reason: str = "failed on the prefill"


class CloseRoom(Input, frozen=True, tag="CloseRoom"):
    """The owner is done with the room: deleted on success, kept as a tombstone on failure."""

    room: int
    generation: int
    owner_id: int
    success: bool


class Superseded(Input, frozen=True, tag="Superseded"):
    """A later generation of the room id arrived: an ownerless earlier one is forgotten."""

    room: int
    generation: int
    by: int


class Evicted(Input, frozen=True, tag="Evicted"):
    """The oldest tombstone makes way for an ownerless entry past the table's cap."""

    room: int
    generation: int


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
    generation: int
    owner: int | None
    endpoint: PeerId | None
    ready_notified: bool
    failure_notified: bool
    expires_at: float | None
    reason: str


class PrefillCompleteSnapshot(msgspec.Struct, frozen=True):
    ttl_s: float
    rooms: tuple[BootstrapRoomSnapshot, ...]


Keyed = ClaimRoom | BootstrapArrived | MarkComplete | FailRoom | CloseRoom

_FAILED_STATES = (BootstrapRoomState.FAILED, BootstrapRoomState.TOMBSTONE)
_OWNERLESS = (BootstrapRoomState.UNOWNED, BootstrapRoomState.TOMBSTONE)


class BootstrapRoom(TableMachine[BootstrapRoomState]):
    """One (room, generation) of the table: ``{owner, endpoint, notified, expires_at}``."""

    table: Table[BootstrapRoomState]

    def __init__(
        self, room: int, generation: int, me: PeerId, ttl_s: float,
        newest: Callable[[], int | None], full_of_waiting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.key = room
        self.generation = generation
        self.me = me
        self.ttl_s = ttl_s
        self.newest = newest
        """The latest generation of this room id the table holds."""
        self.full_of_waiting = full_of_waiting
        """Whether the table holds as many ownerless entries as it may, none a tombstone."""
        self.state = BootstrapRoomState.ABSENT
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
            generation=self.generation,
            owner=self.owner,
            endpoint=self.endpoint,
            ready_notified=self.ready_notified,
            failure_notified=self.failure_notified,
            expires_at=self.expires_at,
            reason=self.reason,
        )

    # ---- guards --------------------------------------------------------------------------------
    def _guard_same_endpoint(self, inp: BootstrapArrived, now: float) -> bool:
        return inp.endpoint == self.endpoint

    def _guard_no_endpoint_yet(self, inp: BootstrapArrived, now: float) -> bool:
        return self.endpoint is None

    def _guard_foreign_owner(self, inp: MarkComplete | CloseRoom, now: float) -> bool:
        return inp.owner_id != self.owner

    def _guard_succeeded(self, inp: CloseRoom, now: float) -> bool:
        return inp.success

    def _guard_expired(self, inp: Tick, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def _guard_superseded(self, inp: BootstrapArrived | FailRoom, now: float) -> bool:
        newest = self.newest()
        return newest is not None and newest > self.generation

    def _guard_full_of_waiting(self, inp: Keyed, now: float) -> bool:
        return self.full_of_waiting()

    # ---- actions -------------------------------------------------------------------------------
    def _act_open(self, inp: ClaimRoom, now: float) -> list[Output]:
        self.owner = inp.owner_id
        self.expires_at = None  # an owned room lives as long as its owner
        return []

    def _act_refuse_owner(self, inp: ClaimRoom, now: float) -> list[Output]:
        return [OwnerRefused(inp.room, inp.owner_id, DUPLICATE_ROOM)]

    def _act_drop_table_full(self, inp: BootstrapArrived | FailRoom, now: float) -> list[Output]:
        what = "bootstrap" if isinstance(inp, BootstrapArrived) else "cancel before the sender"
        return [Dropped(TABLE_FULL, f"room {inp.room}/{inp.generation}: {what} dropped, the "
                        "ready table holds max_ownerless_ready_rooms ownerless rooms")]  # fmt: skip

    def _act_register(self, inp: BootstrapArrived, now: float) -> list[Output]:
        self.endpoint = inp.endpoint
        return []

    def _act_register_unowned(self, inp: BootstrapArrived, now: float) -> list[Output]:
        self.expires_at = now + self.ttl_s
        return self._act_register(inp, now)

    def _act_register_and_notify(self, inp: BootstrapArrived, now: float) -> list[Output]:
        self._act_register(inp, now)
        if self.state is BootstrapRoomState.READY:
            return self._notify_ready()
        return self._notify_failure()

    def _act_refuse_endpoint(self, inp: BootstrapArrived, now: float) -> list[Output]:
        bound = self.endpoint.address if self.endpoint is not None else "another endpoint"
        reason = f"room {inp.room} is already bound to decode endpoint {bound}"
        return [self._notice(inp.endpoint, KVPoll.Failed, reason)]

    def _act_complete(self, inp: MarkComplete, now: float) -> list[Output]:
        return self._notify_ready()

    def _act_fail(self, inp: FailRoom | CloseRoom, now: float) -> list[Output]:
        self.reason = inp.reason if isinstance(inp, FailRoom) else "the owner closed it unfinished"
        return self._notify_failure()

    def _act_bury(self, inp: FailRoom | CloseRoom, now: float) -> list[Output]:
        self.owner = None
        self.expires_at = now + self.ttl_s
        return []

    def _act_entomb(self, inp: FailRoom | CloseRoom, now: float) -> list[Output]:
        outputs = self._act_fail(inp, now)
        self._act_bury(inp, now)
        return outputs

    def _act_forget(self, inp: Input, now: float) -> list[Output]:
        self.owner = None
        self.expires_at = None
        return []

    def _act_fail_and_forget(self, inp: CloseRoom, now: float) -> list[Output]:
        outputs = self._act_fail(inp, now)
        self._act_forget(inp, now)
        return outputs

    def _act_notify_superseded(self, inp: Superseded, now: float) -> list[Output]:
        self.reason = f"superseded by generation {inp.by} of the room id"
        outputs = self._notify_failure()
        self._act_forget(inp, now)
        return outputs

    # ---- helpers -------------------------------------------------------------------------------
    def _notify_ready(self) -> list[Output]:
        if self.endpoint is None or self.ready_notified:
            return []
        self.ready_notified = True
        return [self._notice(self.endpoint, KVPoll.WaitingForInput, "")]

    def _notify_failure(self) -> list[Output]:
        if self.endpoint is None or self.failure_notified:
            return []
        self.failure_notified = True
        return [self._notice(self.endpoint, KVPoll.Failed, self.reason)]

    def _notice(self, endpoint: PeerId, status: KVPoll, reason: str) -> SendMessage:
        report = StatusReport(
            room=self.key,
            generation=self.generation,
            status=status,
            prefill=self.me,
            decode=endpoint,
            reason=reason,
        )
        return SendMessage(to=endpoint, message=report)


_B = BootstrapRoomState
_R = BootstrapRoom
_NOTICE = "send.status"
_REFUSED = "owner_refused"
_DROPPED = "dropped"

PREFILL_COMPLETE_TABLE: Table[BootstrapRoomState] = Table(
    machine="PrefillComplete",
    states=BootstrapRoomState,
    initial=BootstrapRoomState.ABSENT,
    inputs=(
        ClaimRoom, BootstrapArrived, MarkComplete, FailRoom, CloseRoom, Superseded, Evicted, Tick,
    ),
    remote_inputs=(BootstrapArrived,),
    rows=[
        # -- ABSENT: no record of this generation --------------------------------------------------
        row(_B.ABSENT, ClaimRoom, _B.OWNED, action=_R._act_open),
        row(_B.ABSENT, BootstrapArrived, _B.ABSENT, guard=_R._guard_superseded),  # stale: dropped
        row(_B.ABSENT, BootstrapArrived, _B.ABSENT,
            guard=_R._guard_full_of_waiting, emits=[_DROPPED], action=_R._act_drop_table_full),
        row(_B.ABSENT, BootstrapArrived, _B.UNOWNED, action=_R._act_register_unowned),
        row(_B.ABSENT, MarkComplete, _B.ABSENT),  # not the owner of anything: ignored
        row(_B.ABSENT, FailRoom, _B.ABSENT, guard=_R._guard_superseded),  # a later one is known
        row(_B.ABSENT, FailRoom, _B.ABSENT,
            guard=_R._guard_full_of_waiting, emits=[_DROPPED], action=_R._act_drop_table_full),
        row(_B.ABSENT, FailRoom, _B.TOMBSTONE, action=_R._act_entomb),  # cancel before the sender
        row(_B.ABSENT, CloseRoom, _B.ABSENT),
        # -- UNOWNED: a decode endpoint waits; no sender yet ------------------------------------
        row(_B.UNOWNED, ClaimRoom, _B.OWNED, action=_R._act_open),
        row(_B.UNOWNED, BootstrapArrived, _B.UNOWNED, guard=_R._guard_same_endpoint),
        row(_B.UNOWNED, BootstrapArrived, _B.UNOWNED,
            emits=[_NOTICE], action=_R._act_refuse_endpoint),
        row(_B.UNOWNED, MarkComplete, _B.UNOWNED),
        row(_B.UNOWNED, FailRoom, _B.TOMBSTONE, emits=[_NOTICE], action=_R._act_entomb),
        row(_B.UNOWNED, CloseRoom, _B.UNOWNED),
        row(_B.UNOWNED, Superseded, _B.ABSENT, emits=[_NOTICE], action=_R._act_notify_superseded),
        row(_B.UNOWNED, Tick, _B.ABSENT, guard=_R._guard_expired, action=_R._act_forget),
        row(_B.UNOWNED, Tick, _B.UNOWNED),
        # -- OWNED: the sender computes -----------------------------------------------------------
        row(_B.OWNED, ClaimRoom, _B.OWNED, emits=[_REFUSED], action=_R._act_refuse_owner),
        row(_B.OWNED, BootstrapArrived, _B.OWNED,
            guard=_R._guard_no_endpoint_yet, action=_R._act_register),
        row(_B.OWNED, BootstrapArrived, _B.OWNED, guard=_R._guard_same_endpoint),
        row(_B.OWNED, BootstrapArrived, _B.OWNED,
            emits=[_NOTICE], action=_R._act_refuse_endpoint),
        row(_B.OWNED, MarkComplete, _B.OWNED, guard=_R._guard_foreign_owner),
        row(_B.OWNED, MarkComplete, _B.READY, emits=[_NOTICE], action=_R._act_complete),
        row(_B.OWNED, FailRoom, _B.FAILED, emits=[_NOTICE], action=_R._act_fail),
        row(_B.OWNED, CloseRoom, _B.OWNED, guard=_R._guard_foreign_owner),
        row(_B.OWNED, CloseRoom, _B.ABSENT, guard=_R._guard_succeeded, action=_R._act_forget),
        row(_B.OWNED, CloseRoom, _B.ABSENT,
            guard=_R._guard_full_of_waiting, emits=[_NOTICE], action=_R._act_fail_and_forget),
        row(_B.OWNED, CloseRoom, _B.TOMBSTONE, emits=[_NOTICE], action=_R._act_entomb),
        row(_B.OWNED, Tick, _B.OWNED),
        # -- READY: the prefill finished; the ready notice went out (or waits for the endpoint) --
        row(_B.READY, ClaimRoom, _B.READY, emits=[_REFUSED], action=_R._act_refuse_owner),
        row(_B.READY, BootstrapArrived, _B.READY,
            guard=_R._guard_no_endpoint_yet, emits=[_NOTICE], action=_R._act_register_and_notify),
        row(_B.READY, BootstrapArrived, _B.READY, guard=_R._guard_same_endpoint),
        row(_B.READY, BootstrapArrived, _B.READY,
            emits=[_NOTICE], action=_R._act_refuse_endpoint),
        row(_B.READY, MarkComplete, _B.READY),  # never a second ready notice
        row(_B.READY, FailRoom, _B.FAILED, emits=[_NOTICE], action=_R._act_fail),
        row(_B.READY, CloseRoom, _B.READY, guard=_R._guard_foreign_owner),
        row(_B.READY, CloseRoom, _B.ABSENT, guard=_R._guard_succeeded, action=_R._act_forget),
        row(_B.READY, CloseRoom, _B.ABSENT,
            guard=_R._guard_full_of_waiting, emits=[_NOTICE], action=_R._act_fail_and_forget),
        row(_B.READY, CloseRoom, _B.TOMBSTONE, emits=[_NOTICE], action=_R._act_entomb),
        row(_B.READY, Tick, _B.READY),
        # -- FAILED: failed while the owner still holds it --------------------------------------
        row(_B.FAILED, ClaimRoom, _B.FAILED, emits=[_REFUSED], action=_R._act_refuse_owner),
        row(_B.FAILED, BootstrapArrived, _B.FAILED,
            guard=_R._guard_no_endpoint_yet, emits=[_NOTICE], action=_R._act_register_and_notify),
        row(_B.FAILED, BootstrapArrived, _B.FAILED, guard=_R._guard_same_endpoint),
        row(_B.FAILED, BootstrapArrived, _B.FAILED,
            emits=[_NOTICE], action=_R._act_refuse_endpoint),
        row(_B.FAILED, MarkComplete, _B.FAILED),  # failure beats a late ready
        row(_B.FAILED, FailRoom, _B.FAILED),
        row(_B.FAILED, CloseRoom, _B.FAILED, guard=_R._guard_foreign_owner),
        row(_B.FAILED, CloseRoom, _B.ABSENT,
            guard=_R._guard_full_of_waiting, action=_R._act_forget),
        row(_B.FAILED, CloseRoom, _B.TOMBSTONE, action=_R._act_bury),
        row(_B.FAILED, Tick, _B.FAILED),
        # -- TOMBSTONE: failed and ownerless, kept until it expires or is superseded -------------
        row(_B.TOMBSTONE, ClaimRoom, _B.TOMBSTONE, emits=[_REFUSED], action=_R._act_refuse_owner),
        row(_B.TOMBSTONE, BootstrapArrived, _B.TOMBSTONE,
            guard=_R._guard_no_endpoint_yet, emits=[_NOTICE], action=_R._act_register_and_notify),
        row(_B.TOMBSTONE, BootstrapArrived, _B.TOMBSTONE, guard=_R._guard_same_endpoint),
        row(_B.TOMBSTONE, BootstrapArrived, _B.TOMBSTONE,
            emits=[_NOTICE], action=_R._act_refuse_endpoint),
        row(_B.TOMBSTONE, MarkComplete, _B.TOMBSTONE),
        row(_B.TOMBSTONE, FailRoom, _B.TOMBSTONE),
        row(_B.TOMBSTONE, CloseRoom, _B.TOMBSTONE),
        row(_B.TOMBSTONE, Superseded, _B.ABSENT, action=_R._act_forget),
        row(_B.TOMBSTONE, Evicted, _B.ABSENT, action=_R._act_forget),  # past the cap: oldest goes
        row(_B.TOMBSTONE, Tick, _B.ABSENT, guard=_R._guard_expired, action=_R._act_forget),
        row(_B.TOMBSTONE, Tick, _B.TOMBSTONE),
    ],
)  # fmt: skip
BootstrapRoom.table = PREFILL_COMPLETE_TABLE


class PrefillCompleteTable:
    """Every ``prefill_complete`` room of one prefill rank, by (room, generation).

    Bounded per room id: when a later generation of a room id arrives, every ownerless earlier
    one (a waiting endpoint, a tombstone) is superseded, and an input for an earlier generation
    than the latest creates nothing. Drive it with :meth:`handle`.
    """

    def __init__(
        self, me: PeerId, timeouts: Timeouts = Timeouts(), max_ownerless: int = 65_536,  # noqa: B008
    ) -> None:
        self.me = me
        self.ttl_s = timeouts.waiting_timeout + timeouts.bootstrap_timeout
        self.max_ownerless = max_ownerless
        self._rooms: dict[int, dict[int, BootstrapRoom]] = {}
        self._ownerless: set[tuple[int, int]] = set()
        """The (room, generation) entries no sender owns (UNOWNED, TOMBSTONE), at most
        max_ownerless: only they are kept for a TTL without a local owner."""
        self._tombstones: OrderedDict[tuple[int, int], None] = OrderedDict()
        """The TOMBSTONE entries, oldest first: the one evicted past the cap is found in O(1)."""
        # Each held room's expiry, so a step finds the next one in O(log n): the endpoint asks
        # for it on every step, and walking every held room made each step O(rooms).
        self._expiries: DeadlineQueue[tuple[int, int]] = DeadlineQueue()

    def state_of(self, room: int, generation: int) -> BootstrapRoomState:
        held = self._rooms.get(room, {}).get(generation)
        return held.state if held is not None else BootstrapRoomState.ABSENT

    def is_failed(self, room: int, generation: int) -> bool:
        return self.state_of(room, generation) in _FAILED_STATES

    def newest(self, room: int) -> int | None:
        """The latest generation of the room id the table holds (None: it holds none, so no
        generation is superseded, whatever its number)."""
        return max(self._rooms.get(room, {}), default=None)

    def held(self) -> int:
        """(room, generation) entries held: at most a few per room id."""
        return sum(len(gens) for gens in self._rooms.values())

    def ownerless(self) -> int:
        """Entries held with no local owner: at most ``max_ownerless``."""
        return len(self._ownerless)

    def _full_of_waiting(self) -> bool:
        return len(self._ownerless) >= self.max_ownerless and not self._tombstones

    def timer_at(self) -> float | None:
        return self._expiries.earliest

    def snapshot(self) -> PrefillCompleteSnapshot:
        rooms = tuple(
            self._rooms[key][gen].snapshot()
            for key in sorted(self._rooms)
            for gen in sorted(self._rooms[key])
        )
        return PrefillCompleteSnapshot(self.ttl_s, rooms)

    def handle(self, inp: Input, now: float) -> Step:
        if isinstance(inp, Tick):
            return self._sweep(inp, now)
        if not isinstance(inp, (ClaimRoom, BootstrapArrived, MarkComplete, FailRoom, CloseRoom)):
            raise InvalidInput(f"PrefillCompleteTable does not take {type(inp).__name__}")
        machine = self._machine(inp)
        outputs, one = machine.fire(inp, now)
        fired = [one]
        self._keep_or_forget(machine)
        outputs.extend(self._supersede_earlier(inp.room, now, fired))
        self._evict_past_cap(now, fired)
        return Step(tuple(outputs), self.timer_at(), tuple(fired))

    def _machine(self, inp: Keyed) -> BootstrapRoom:
        held = self._rooms.get(inp.room, {}).get(inp.generation)
        if held is not None:
            return held
        room = inp.room
        return BootstrapRoom(room, inp.generation, self.me, self.ttl_s,
                             lambda: self.newest(room), self._full_of_waiting)  # fmt: skip

    def _supersede_earlier(self, room: int, now: float, fired: list[Fired]) -> list[Output]:
        outputs: list[Output] = []
        latest = self.newest(room)
        if latest is None:
            return outputs
        earlier = self._rooms[room]
        for generation in sorted(g for g in earlier if g < latest):
            machine = earlier[generation]
            if machine.state in _OWNERLESS:
                produced, one = machine.fire(Superseded(room, generation, latest), now)
                outputs.extend(produced)
                fired.append(one)
                self._keep_or_forget(machine)
        return outputs

    def _evict_past_cap(self, now: float, fired: list[Fired]) -> None:
        """The input added an ownerless entry past the cap: the oldest tombstone goes (the
        guard full_of_waiting let it through only because one is held)."""
        if len(self._ownerless) <= self.max_ownerless:
            return
        room, generation = next(iter(self._tombstones))
        machine = self._rooms[room][generation]
        _, one = machine.fire(Evicted(room, generation), now)
        fired.append(one)
        self._keep_or_forget(machine)

    def _sweep(self, tick: Tick, now: float) -> Step:
        fired: list[Fired] = []
        for room, generation in self._expiries.pop_due(now):
            machine = self._rooms[room][generation]
            _, one = machine.fire(tick, now)
            fired.append(one)
            self._keep_or_forget(machine)
        return Step((), self.timer_at(), tuple(fired))

    def _keep_or_forget(self, machine: BootstrapRoom) -> None:
        key = (machine.key, machine.generation)
        gens = self._rooms.setdefault(machine.key, {})
        if machine.state is BootstrapRoomState.ABSENT:
            gens.pop(machine.generation, None)
            if not gens:
                del self._rooms[machine.key]
            self._expiries.arm(key, None)
        else:
            gens[machine.generation] = machine
            self._expiries.arm(key, machine.expires_at)
        if machine.state in _OWNERLESS:
            self._ownerless.add(key)
        else:
            self._ownerless.discard(key)
        if machine.state is BootstrapRoomState.TOMBSTONE:
            self._tombstones.setdefault(key)  # a tombstone stays one: its age is kept
        else:
            self._tombstones.pop(key, None)
