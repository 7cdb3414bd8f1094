"""PageLedger: who owns each decode destination page, and when a failed room's pages may be reused.

A page is FREE, RESERVED by one room instance ``(room, generation)``, or QUARANTINED by a fenced
room. A room that failed after publishing its pages is fenced: each prefill rank that may still
write into them (a *writer*) must be cleared first, by its drain ACK, or by being declared dead
*and* fenced on the decode's receiving side (SessionClosed: then no write can land), or by the
retirement of the transport session the room was published under (SessionRetired: the decode
destroyed that engine, so no write of any writer through it can land). Neither a
heartbeat verdict alone (WriterDead) nor a timeout ever frees a quarantined page;
:meth:`PageLedger.report` shows how long each has been held instead, and
:attr:`PageLedger.allocatable` leaves quarantined pages out so admission sees the smaller pool.

The decode's own verification is a writer too (on a staged decode it scatters the staged slices
into the pages): while it runs the room's pages are VERIFYING, and a release then (the engine
cleared a room aborted mid-verification) waits in RELEASING until the shell reports that work
done (VerifyDone), so no page is handed out under the scatter.

Each room instance is a table machine (``[machines.PageLedger]`` in spec/machines/page_ledger.toml);
the ledger routes inputs to them. Instances are keyed by ``(room, generation)``, so an ACK of an
earlier use of a room id can only ever reach that earlier instance, never the new one's pages.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from typing import Any, cast

import msgspec

from pdflow.core.framework.dispatch import remembered_kind
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.step import Step
from pdflow.core.framework.table import Fired, Table, TableMachine, row
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.messages import PeerId, peer_order
from pdflow.core.protocol.outputs import Output


class RoomPagesState(enum.Enum):
    FREE = "FREE"
    RESERVED = "RESERVED"
    VERIFYING = "VERIFYING"
    RELEASING = "RELEASING"
    FENCED = "FENCED"


# ---- inputs ------------------------------------------------------------------------------------
class Reserve(Input, frozen=True, tag="Reserve"):
    """The engine takes these free pages for one room instance."""

    room: int
    generation: int
    pages: tuple[int, ...]


class ReleaseAfterSuccess(Input, frozen=True, tag="ReleaseAfterSuccess"):
    """The engine is done with a room whose transfer succeeded: every writer has finished."""

    room: int
    generation: int


class VerifyStarted(Input, frozen=True, tag="VerifyStarted"):
    """The room asked its shell to verify what landed: that local work touches the pages."""

    room: int
    generation: int


class VerifyDone(Input, frozen=True, tag="VerifyDone"):
    """The shell's verification of the room finished (or was cancelled and joined): nothing
    local writes the pages any more."""

    room: int
    generation: int


class ReleaseUnpublished(Input, frozen=True, tag="ReleaseUnpublished"):
    """The room failed before its pages were published: no writer knows them."""

    room: int
    generation: int


class Fence(Input, frozen=True, tag="Fence"):
    """The room failed after publishing: hold its pages until every writer is cleared.

    ``session`` is the decode's transport session the room told its writers to write to;
    retiring it (SessionRetired) clears every writer of the room at once."""

    room: int
    generation: int
    writers: tuple[PeerId, ...]
    session: str = ""


class AckArrived(Input, frozen=True, tag="AckArrived"):
    """A prefill rank's drain ACK: none of its writes into this room can still land."""

    room: int
    generation: int
    writer: PeerId


class WriterDead(Input, frozen=True, tag="WriterDead"):
    """The heartbeat declared this prefill rank (one process life) dead."""

    writer: PeerId


class WriterReadmitted(Input, frozen=True, tag="WriterReadmitted"):
    """A writer wrongly declared dead answered again and owes no drain ACK: it is alive.

    The dead verdict and the fence are lifted for the writes it issues from now on (the shell
    lifts the transport fence for those only). A room that cleared this writer while it was
    dead and fenced keeps it cleared: its drain ACK for that room already arrived.
    """

    writer: PeerId


class SessionClosed(Input, frozen=True, tag="SessionClosed"):
    """The shell fenced this writer on the decode's own receiving side: nothing it sent or
    sends can land any more.

    Handed over only once a transport whose fence is real returned from ``fence``; where the
    transport has none, the shell never sends it and the writer's pages wait for its drain
    ACK. The fence is permanent for the PeerId (a restarted process has a new incarnation,
    hence a new PeerId), so the fact is permanent.
    """

    writer: PeerId


class SessionRetired(Input, frozen=True, tag="SessionRetired"):
    """The shell destroyed the decode's transport engine behind this session (its io thread
    joined, every connection closed): no write of any writer through it can land any more.

    Handed over only after the engine's destruction returned (fence by engine rotation,
    docs/operations.md); it frees every fenced room published under that session.
    """

    session: str


_WRITER_NEWS = (WriterDead, SessionClosed, SessionRetired, WriterReadmitted)
"""Inputs about a writer (or a session), not one room instance."""
_ROOM_INPUTS = (
    Reserve,
    VerifyStarted,
    VerifyDone,
    ReleaseAfterSuccess,
    ReleaseUnpublished,
    Fence,
    AckArrived,
)
"""Inputs for one room instance, keyed by (room, generation)."""
_LEDGER_INPUTS: frozenset[type] = frozenset(_WRITER_NEWS + _ROOM_INPUTS)
_LEDGER_INPUT_KIND: dict[type, type] = {}
"""Each input class the ledger was given, mapped to the ledger input it is an instance of
(compared by type with ``is`` on every step: framework/dispatch.py)."""

LedgerInput = (
    Reserve
    | VerifyStarted
    | VerifyDone
    | ReleaseAfterSuccess
    | ReleaseUnpublished
    | Fence
    | AckArrived
    | WriterDead
    | SessionClosed
    | SessionRetired
    | WriterReadmitted
)


# ---- outputs -----------------------------------------------------------------------------------
class PagesFreed(Output, frozen=True, tag="pages_freed"):
    """These pages went back to FREE: the engine may hand them to another room."""

    room: int
    generation: int
    pages: tuple[int, ...]


class PagesQuarantined(Output, frozen=True, tag="pages_quarantined"):
    """These pages are held until each writer listed is cleared (never by a timeout)."""

    room: int
    generation: int
    pages: tuple[int, ...]
    writers: tuple[PeerId, ...]


# ---- observable state ----------------------------------------------------------------------
class RoomPagesSnapshot(msgspec.Struct, frozen=True):
    room: int
    generation: int
    state: str
    pages: tuple[int, ...]
    writers: tuple[PeerId, ...]
    acked: tuple[PeerId, ...]
    fenced_at: float | None


class LedgerSnapshot(msgspec.Struct, frozen=True):
    pool_size: int
    free: int
    reserved: int
    quarantined: int
    rooms: tuple[RoomPagesSnapshot, ...]
    dead_writers: tuple[PeerId, ...]
    closed_sessions: tuple[PeerId, ...]
    retired_sessions: tuple[str, ...] = ()


class QuarantinedRoom(msgspec.Struct, frozen=True):
    """One fenced room as an operator sees it: what it holds, for whom, for how long."""

    room: int
    generation: int
    pages: tuple[int, ...]
    waiting_on: tuple[PeerId, ...]
    age_s: float
    staging_bytes: int = 0
    """Staging-ring bytes the room holds with its pages (a staged decode's endpoint adds them)."""


_P = RoomPagesState
# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_FREE, _FENCED = RoomPagesState.FREE, RoomPagesState.FENCED
_FREED = "pages_freed"
_QUARANTINED = "pages_quarantined"


class PagePool:
    """Page ownership shared by every room instance of one ledger."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise InvalidInput(f"pool size must be >= 0, got {size}")
        self.size = size
        self.owner: dict[int, tuple[int, int]] = {}

    def check_free(self, pages: tuple[int, ...]) -> None:
        size, owner = self.size, self.owner
        for page in pages:
            if not 0 <= page < size or page in owner:
                break
        else:
            if len(set(pages)) == len(pages):
                return  # every page is in the pool and free: the usual case, one pass
        if len(set(pages)) != len(pages):
            raise InvalidInput(f"pages must be distinct, got {pages}")
        outside = [p for p in pages if not 0 <= p < self.size]
        if outside:
            raise InvalidInput(f"pages {outside} are outside the pool [0, {self.size})")
        taken = {p: self.owner[p] for p in pages if p in self.owner}
        if taken:
            raise InvalidInput(
                f"pages not free (page -> (room, generation)): {taken}; "
                "reserve only pages the ledger reports free"
            )


class WriterHealth:
    """What the shell told the ledger about writers, and the drain ACKs each still owes.

    A dead verdict (with its fence) holds until the writer is readmitted, which the endpoint
    allows only once the writer answered again and owes no ACK.
    """

    def __init__(self) -> None:
        self.dead: set[PeerId] = set()
        self.closed: set[PeerId] = set()
        self.retired: set[str] = set()
        self.owed: dict[PeerId, dict[tuple[int, int], str]] = {}
        """Fenced room instances whose ABORT each writer has not ACKed yet, with the session
        each was published under."""
        self.readmitted: set[PeerId] = set()

    def cannot_write(self, writer: PeerId) -> bool:
        return writer in self.dead and writer in self.closed

    def owe(self, writers: tuple[PeerId, ...], room: int, generation: int, session: str) -> None:
        if session and session in self.retired:
            return  # nothing written through a destroyed engine can land: no ACK is owed
        for writer in writers:
            self.owed.setdefault(writer, {})[(room, generation)] = session

    def acked(self, writer: PeerId, room: int, generation: int) -> None:
        owed = self.owed.get(writer)
        if owed is not None:
            owed.pop((room, generation), None)
            if not owed:
                del self.owed[writer]

    def retire(self, session: str) -> None:
        """The session's engine is destroyed: nothing written through it can land, so no
        writer owes an ACK for a room published under it."""
        self.retired.add(session)
        if not session:
            return  # rooms fenced without a session are never freed by a retirement
        for writer, owed in list(self.owed.items()):
            for key in [k for k, s in owed.items() if s == session]:
                del owed[key]
            if not owed:
                del self.owed[writer]


class RoomPages(TableMachine[RoomPagesState]):
    """The pages of one room instance. The ledger creates, routes to and forgets these."""

    table: Table[RoomPagesState]

    def __init__(self, room: int, generation: int, pool: PagePool, health: WriterHealth) -> None:
        self.key = room
        self.generation = generation
        self.state = PAGE_LEDGER_TABLE.initial
        self._pool = pool
        self._health = health
        self.pages: tuple[int, ...] = ()
        self.writers: tuple[PeerId, ...] = ()
        self.acked: set[PeerId] = set()
        self.fenced_at: float | None = None
        self.session = ""

    def holds_pages(self) -> bool:
        return self.state is not _FREE

    def pending_writers(self) -> tuple[PeerId, ...]:
        """Writers of a fenced room not yet cleared (none once its session is retired)."""
        if self.session and self.session in self._health.retired:
            return ()
        return tuple(
            w for w in self.writers if w not in self.acked and not self._health.cannot_write(w)
        )

    def snapshot(self) -> RoomPagesSnapshot:
        return RoomPagesSnapshot(
            room=self.key,
            generation=self.generation,
            state=self.state.name,
            pages=self.pages,
            writers=self.writers,
            acked=tuple(w for w in self.writers if w in self.acked),
            fenced_at=self.fenced_at,
        )

    # ---- validation ----------------------------------------------------------------------------
    def _validate(self, inp: Input, now: float) -> None:
        kind = _LEDGER_INPUT_KIND.get(type(inp))
        if kind is None:
            kind = remembered_kind(inp, _LEDGER_INPUTS, _LEDGER_INPUT_KIND)
        if kind in _WRITER_NEWS:
            return
        if kind not in _ROOM_INPUTS:
            raise InvalidInput(f"the page ledger does not take {type(inp).__name__}")
        keyed: Any = inp  # one of _ROOM_INPUTS: keyed by (room, generation)
        if keyed.room != self.key or keyed.generation != self.generation:
            raise InvalidInput(
                f"input for room {keyed.room}/{keyed.generation} routed to "
                f"{self.key}/{self.generation}"
            )
        if kind is Reserve:
            self._pool.check_free(keyed.pages)
        elif kind is Fence and len(set(keyed.writers)) != len(keyed.writers):
            raise InvalidInput(f"room {self.key}: fence writers must be distinct: {keyed.writers}")

    # ---- guards --------------------------------------------------------------------------------
    def _guard_no_writer_can_land(self, inp: Fence, now: float) -> bool:
        fence = inp
        if fence.session and fence.session in self._health.retired:
            return True
        return all(self._health.cannot_write(w) for w in fence.writers)

    def _guard_clears_last_writer(self, inp: AckArrived, now: float) -> bool:
        return self.pending_writers() == (inp.writer,)

    def _guard_owed_by_writer(self, inp: AckArrived, now: float) -> bool:
        return inp.writer in self.pending_writers()

    def _guard_all_writers_cleared(self, inp: Input, now: float) -> bool:
        return not self.pending_writers()

    # ---- actions -------------------------------------------------------------------------------
    def _act_reserve(self, inp: Reserve, now: float) -> list[Output]:
        self.pages = inp.pages
        for page in self.pages:
            self._pool.owner[page] = (self.key, self.generation)
        return []

    def _act_quarantine(self, inp: Fence, now: float) -> list[Output]:
        fence = inp
        self.writers = fence.writers
        self.session = fence.session
        self.fenced_at = now
        return [PagesQuarantined(self.key, self.generation, self.pages, self.pending_writers())]

    def _act_record_ack(self, inp: AckArrived, now: float) -> list[Output]:
        self.acked.add(inp.writer)
        return []

    def _act_keep_cleared(self, inp: WriterReadmitted, now: float) -> list[Output]:
        # Called before the verdict is lifted: a writer the room no longer waits on stays so.
        if self._health.cannot_write(inp.writer):
            self.acked.add(inp.writer)
        return []

    def _act_ack_and_free(self, inp: AckArrived, now: float) -> list[Output]:
        self._act_record_ack(inp, now)
        return self._act_free(inp, now)

    def _act_free(self, inp: Input, now: float) -> list[Output]:
        for page in self.pages:
            del self._pool.owner[page]
        freed = PagesFreed(self.key, self.generation, self.pages)
        self.pages = ()
        return [freed]


_M = RoomPages
PAGE_LEDGER_TABLE: Table[RoomPagesState] = Table(
    machine="PageLedger",
    states=RoomPagesState,
    initial=RoomPagesState.FREE,
    inputs=(*_ROOM_INPUTS, *_WRITER_NEWS),
    remote_inputs=(AckArrived,),
    rows=[
        # -- FREE: the instance holds nothing (unknown, or already released) ---------------------
        row(_P.FREE, Reserve, _P.RESERVED, action=_M._act_reserve),
        row(_P.FREE, AckArrived, _P.FREE),  # late, duplicate or for an unknown room: harmless
        # -- RESERVED: the room owns its pages; writers may know them ---------------------------
        row(_P.RESERVED, ReleaseAfterSuccess, _P.FREE, emits=[_FREED], action=_M._act_free),
        row(_P.RESERVED, ReleaseUnpublished, _P.FREE, emits=[_FREED], action=_M._act_free),
        row(_P.RESERVED, Fence, _P.FREE,
            guard=_M._guard_no_writer_can_land, emits=[_FREED], action=_M._act_free),
        row(_P.RESERVED, Fence, _P.FENCED, emits=[_QUARANTINED], action=_M._act_quarantine),
        row(_P.RESERVED, AckArrived, _P.RESERVED),  # the fence precedes every ABORT: stale news
        row(_P.RESERVED, VerifyStarted, _P.VERIFYING),
        # -- VERIFYING: every writer finished; the shell's verification (scatter) works on them --
        row(_P.VERIFYING, VerifyDone, _P.RESERVED),
        row(_P.VERIFYING, ReleaseAfterSuccess, _P.RELEASING),
        # -- RELEASING: the engine is done with the room; freed once the local work is -------
        row(_P.RELEASING, VerifyDone, _P.FREE, emits=[_FREED], action=_M._act_free),
        # -- FENCED: pages quarantined until every writer is cleared -----------------------------
        row(_P.FENCED, AckArrived, _P.FREE,
            guard=_M._guard_clears_last_writer, emits=[_FREED], action=_M._act_ack_and_free),
        row(_P.FENCED, AckArrived, _P.FENCED, guard=_M._guard_owed_by_writer,
            action=_M._act_record_ack),
        row(_P.FENCED, AckArrived, _P.FENCED),  # duplicate, or not a writer of this room
        row(_P.FENCED, WriterDead, _P.FREE,
            guard=_M._guard_all_writers_cleared, emits=[_FREED], action=_M._act_free),
        row(_P.FENCED, WriterDead, _P.FENCED),
        row(_P.FENCED, SessionClosed, _P.FREE,
            guard=_M._guard_all_writers_cleared, emits=[_FREED], action=_M._act_free),
        row(_P.FENCED, SessionClosed, _P.FENCED),
        row(_P.FENCED, SessionRetired, _P.FREE,
            guard=_M._guard_all_writers_cleared, emits=[_FREED], action=_M._act_free),
        row(_P.FENCED, SessionRetired, _P.FENCED),  # published under another session
        row(_P.FENCED, WriterReadmitted, _P.FENCED, action=_M._act_keep_cleared),
    ],
)  # fmt: skip
RoomPages.table = PAGE_LEDGER_TABLE


class PageLedger:
    """Every destination page of one decode rank. Drive it with :meth:`handle`.

    Per-room work never depends on how many rooms the ledger holds: a release touches only its
    own instance, and the fenced rooms are indexed apart (with their page count and a heap of
    fence times) so quarantine accounting never walks the reserved ones.
    """

    def __init__(self, num_pages: int) -> None:
        self._pool = PagePool(num_pages)
        self._health = WriterHealth()
        self._rooms: dict[tuple[int, int], RoomPages] = {}
        self._fenced: dict[tuple[int, int], RoomPages] = {}
        self._quarantined_pages = 0
        # (fenced_at, room, generation); entries of rooms no longer fenced are skipped lazily.
        self._fence_times: list[tuple[float, int, int]] = []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def pool_size(self) -> int:
        return self._pool.size

    @property
    def allocatable(self) -> int:
        """Pages admission may hand out: neither reserved nor quarantined."""
        return self._pool.size - len(self._pool.owner)

    @property
    def quarantined_pages(self) -> int:
        """Pages held by fenced rooms (O(1))."""
        return self._quarantined_pages

    def oldest_fenced_at(self) -> float | None:
        """When the longest-quarantined room was fenced; None when none is (O(log n) amortized)."""
        heap = self._fence_times
        while heap:
            fenced_at, room, generation = heap[0]
            held = self._fenced.get((room, generation))
            if held is not None and held.fenced_at == fenced_at:
                return fenced_at
            heapq.heappop(heap)
        return None

    def owes_acks(self, writer: PeerId) -> bool:
        """Whether some fenced room instance still waits for this writer's drain ACK."""
        return writer in self._health.owed

    def is_dead(self, writer: PeerId) -> bool:
        return writer in self._health.dead

    def verdict_lifted(self, writer: PeerId) -> bool:
        """The writer was readmitted and not declared dead again: a fence the shell has yet
        to apply for the earlier verdict is no longer asked for."""
        return writer in self._health.readmitted - self._health.dead

    def is_free(self, page: int) -> bool:
        return 0 <= page < self._pool.size and page not in self._pool.owner

    def check_free(self, pages: tuple[int, ...]) -> None:
        """Raise InvalidInput unless the pages are distinct, in the pool and free: what a
        Reserve of them requires."""
        self._pool.check_free(pages)

    def state_of(self, room: int, generation: int) -> RoomPagesState:
        held = self._rooms.get((room, generation))
        return held.state if held is not None else _FREE

    def snapshot(self) -> LedgerSnapshot:
        rooms = tuple(self._rooms[key].snapshot() for key in sorted(self._rooms))
        quarantined = self._quarantined_pages
        held = len(self._pool.owner)
        return LedgerSnapshot(
            pool_size=self._pool.size,
            free=self._pool.size - held,
            reserved=held - quarantined,
            quarantined=quarantined,
            rooms=rooms,
            dead_writers=tuple(sorted(self._health.dead, key=peer_order)),
            closed_sessions=tuple(sorted(self._health.closed, key=peer_order)),
            retired_sessions=tuple(sorted(self._health.retired)),
        )

    def report(self, now: float) -> tuple[QuarantinedRoom, ...]:
        """Fenced rooms, oldest first: what an operator should chase (a writer that never ACKs)."""
        fenced = list(self._fenced.values())
        fenced.sort(key=lambda r: (cast(float, r.fenced_at), r.key, r.generation))
        return tuple(
            QuarantinedRoom(
                room=r.key,
                generation=r.generation,
                pages=r.pages,
                waiting_on=r.pending_writers(),
                age_s=now - cast(float, r.fenced_at),
            )
            for r in fenced
        )

    # ---- driving -------------------------------------------------------------------------------
    def handle(self, inp: LedgerInput, now: float) -> Step:
        outputs, fired = self.apply(inp, now)
        return Step(tuple(outputs), None, tuple(fired))

    def apply(self, inp: LedgerInput, now: float) -> tuple[Sequence[Output], Sequence[Fired]]:
        """One input, as the outputs and transitions it produced: :meth:`handle` wraps them in
        a Step, an endpoint adds them to its own (no Step built and taken apart again)."""
        kind = _LEDGER_INPUT_KIND.get(type(inp))
        if kind is None:
            kind = remembered_kind(inp, _LEDGER_INPUTS, _LEDGER_INPUT_KIND)
        if kind in _WRITER_NEWS:
            step = self._writer_news(inp, now)  # type: ignore[arg-type]
            return step.outputs, step.fired
        outputs, fired = self._room_step(kind, inp, now)
        return outputs, (fired,)

    def _room_step(self, kind: type, inp: LedgerInput, now: float) -> tuple[list[Output], Fired]:
        """One input for one (room, generation) instance, created on first use."""
        given: Any = inp  # typed again where needed: ``kind is X`` does not narrow ``inp``
        key: tuple[int, int] = (given.room, given.generation)
        machine = self._rooms.get(key) or RoomPages(key[0], key[1], self._pool, self._health)
        was_fenced, pages = machine.state is _FENCED, len(machine.pages)
        outputs, fired = machine.fire(inp, now)
        # The ACKs owed change only once the room took the input: a refused one (a fence of a
        # room holding nothing, or naming a writer twice) must not leave a writer owing an ACK
        # for good, which would keep it from ever being readmitted.
        if kind is Fence:
            fence: Fence = given
            self._health.owe(fence.writers, fence.room, fence.generation, fence.session)
        elif kind is AckArrived:
            ack: AckArrived = given
            self._health.acked(ack.writer, ack.room, ack.generation)
        if not machine.holds_pages():
            self._rooms.pop(key, None)
        else:
            self._rooms[key] = machine
        self._index_fence(key, machine, was_fenced, pages)
        return outputs, fired

    def _index_fence(self, key: tuple[int, int], machine: RoomPages, was_fenced: bool,
                     pages: int) -> None:  # fmt: skip
        """Keep the fenced index and its page count in step with one instance's transition."""
        fenced = machine.state is _FENCED
        if fenced == was_fenced:
            return
        if was_fenced:
            del self._fenced[key]
            self._quarantined_pages -= pages
            return
        self._fenced[key] = machine
        self._quarantined_pages += len(machine.pages)
        heapq.heappush(self._fence_times, (cast(float, machine.fenced_at), key[0], key[1]))
        if len(self._fence_times) > 2 * len(self._fenced) + 64:
            # Stale entries of rooms freed long ago: rebuild (amortized O(1) per fence).
            self._fence_times = [(cast(float, r.fenced_at), k[0], k[1])
                                 for k, r in self._fenced.items()]  # fmt: skip
            heapq.heapify(self._fence_times)

    def dead_held_pages(self) -> int:
        """Pages of fenced rooms that wait only on writers declared dead (O(fenced rooms)):
        what a rotation of the transport session would give back."""
        return sum(len(self._fenced[key].pages) for key in self.dead_held_rooms())

    def dead_held_rooms(self) -> tuple[tuple[int, int], ...]:
        """(room, generation) of the fenced rooms that wait only on writers declared dead."""
        return tuple(
            key for key, r in self._fenced.items()
            if r.pending_writers() and all(w in self._health.dead for w in r.pending_writers())
        )  # fmt: skip

    def sessions_held(self) -> set[str]:
        """The sessions fenced rooms were published under."""
        return {r.session for r in self._fenced.values()}

    def _writer_news(
        self, inp: WriterDead | SessionClosed | SessionRetired | WriterReadmitted, now: float
    ) -> Step:
        health = self._health
        if isinstance(inp, SessionClosed) and inp.writer in health.readmitted - health.dead:
            # A fence reported after the writer was readmitted: its verdict was lifted, and a
            # later death must wait for a fence of its own.
            return Step((), None, ())
        if isinstance(inp, SessionRetired):
            health.retire(inp.session)
        elif isinstance(inp, WriterDead):
            health.dead.add(inp.writer)
        elif isinstance(inp, SessionClosed):
            health.closed.add(inp.writer)
        outputs: list[Output] = []
        fired: list[Fired] = []
        # Only fenced rooms can be waiting on a writer: the reserved ones are never visited.
        for key in sorted(self._fenced):
            machine = self._fenced[key]
            # A retirement is news for every fenced room (those of other sessions stay held).
            if not isinstance(inp, SessionRetired) and inp.writer not in machine.writers:
                continue
            pages = len(machine.pages)
            out, one = machine.fire(inp, now)
            outputs += out
            fired.append(one)
            if not machine.holds_pages():
                del self._rooms[key]
            self._index_fence(key, machine, True, pages)
        if isinstance(inp, WriterReadmitted):
            self._health.dead.discard(inp.writer)
            self._health.closed.discard(inp.writer)
            self._health.readmitted.add(inp.writer)
        return Step(tuple(outputs), None, tuple(fired))
