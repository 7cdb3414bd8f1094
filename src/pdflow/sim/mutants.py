"""Deliberately broken variants of the core (and of the shell's fence and the prefill engine's
source pages, as the simulator models them), one per real bug class, to show the checker bites.

Each mutant patches one method for the duration of a ``with`` block, or swaps one guard or
action in a table's rows (rows hold their functions by reference: the table is patched, not the
class), and restores it afterwards. ``pdflow check --mutants`` (and tests/property/
test_mutants.py) run the model checker under each one and report how many steps it took to
catch it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdflow.core.cluster.registry import REGISTRY_TABLE
from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import HeartbeatResult
from pdflow.core.endpoints.liveness import ProbeTarget, instances_of
from pdflow.core.endpoints.opened_marks import NONE
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.endpoints.prefill_slots import (
    PREFILL_SLOT_TABLE,
    PrefillRoomSlot,
    SlotState,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.table import Fired, Row, Table
from pdflow.core.protocol.inputs import Input, SuccessArrived
from pdflow.core.protocol.outputs import Output, StatusChanged
from pdflow.core.resources.page_ledger import (
    PAGE_LEDGER_TABLE,
    PageLedger,
    RoomPages,
    RoomPagesState,
    SessionClosed,
    WriterHealth,
)
from pdflow.core.rooms.prefill_complete import BootstrapRoom, PrefillCompleteTable
from pdflow.core.rooms.receiver_room import RECEIVER_TABLE, ReceiverRoom, ReceiverState
from pdflow.core.rooms.sender_room import SENDER_TABLE, SenderRoom
from pdflow.sim.engine import DecodeProcess, PrefillProcess
from pdflow.sim.transport import FakeTransport
from pdflow.sim.world import World

Patch = tuple[Any, str, Callable[[Any], Any]]
"""(owner, attribute, make_replacement(original))."""


@dataclass(frozen=True)
class Mutant:
    name: str
    bug_class: str
    description: str
    patches: tuple[Patch, ...]
    first_seed: int = 0
    """Where the hunt for it starts: a bug class only rare worlds reach (found by the checker
    outside CI's seeds) is hunted from the seed that found it; its unit tests catch it too."""


@contextlib.contextmanager
def applied(mutant: Mutant) -> Iterator[Mutant]:
    # An inherited attribute is patched on the class itself and deleted again afterwards.
    saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in mutant.patches]
    try:
        for owner, attr, make in mutant.patches:
            setattr(owner, attr, make(getattr(owner, attr)))
        yield mutant
    finally:
        for owner, attr, original in saved:
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


# ---- replacements ------------------------------------------------------------------------------
def _always(value: bool) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def guard(self: Any, inp: Input, now: float) -> bool:
            return value

        return guard

    return make


def _ack_only_last_peer(original: Any) -> Any:
    def ack_everyone(self: SenderRoom) -> list[Output]:
        acks: list[Output] = original(self)
        return acks[-1:]

    return ack_everyone


def _lift_failed(original: Any) -> Any:
    def fire(self: ReceiverRoom, inp: Input, now: float) -> tuple[list[Output], Fired]:
        if self.state is ReceiverState.FAILED and isinstance(inp, SuccessArrived):
            # max(Failed, Success) as a status merge: the late Success wins.
            self.state = ReceiverState.SUCCESS
            change = StatusChanged(self.key, self.generation, KVPoll.Success)
            return [change], Fired(self.table.machine, self.key, "FAILED", "SuccessArrived",
                                   None, "SUCCESS")  # fmt: skip
        result: tuple[list[Output], Fired] = original(self, inp, now)
        return result

    return fire


def _accept_duplicate_claim(original: Any) -> Any:
    def open_(self: PrefillEndpoint, inp: Any, now: float, outputs: Any, fired: Any) -> None:
        self.rooms.pop(inp.room, None)  # the second claim silently replaces the first
        original(self, inp, now, outputs, fired)

    return open_


def _heartbeat_keeps_rooms(original: Any) -> Any:
    def instance_lost(
        self: DecodeEndpoint, target: Any, peers: Any, now: float, out: Any, fired: Any
    ) -> None:
        rooms, self.rooms = self.rooms, {}  # the loss is noted, but no room is failed
        try:
            original(self, target, peers, now, out, fired)
        finally:
            self.rooms = rooms

    return instance_lost


def _never_owes(original: Any) -> Any:
    def owes_acks(self: PageLedger, writer: Any) -> bool:
        return False

    return owes_acks


def _chunk_offset_reused(original: Any) -> Any:
    def send_chunk(self: SenderRoom, inp: Input, now: float) -> list[Output]:
        start = self.next_page
        self.next_page = 0  # every chunk is written at the first destination pages
        outputs: list[Output] = original(self, inp, now)
        self.next_page += start
        return outputs

    return send_chunk


def _wait_clock_not_reset(original: Any) -> Any:
    def restart(self: ReceiverRoom, inp: Input, now: float) -> list[Output]:
        return []

    return restart


def _success_one_short(original: Any) -> Any:
    def completes(self: ReceiverRoom, inp: Input) -> bool:
        success = inp if isinstance(inp, SuccessArrived) else None
        assert success is not None
        distinct = len(self.succeeded | {success.prefill: None})
        return distinct + 1 >= self.required_responses

    return completes


def _restart_not_detected(original: Any) -> Any:
    def heartbeat(
        self: DecodeEndpoint, inp: HeartbeatResult, now: float, out: Any, fired: Any
    ) -> None:
        if inp.ok:  # the incarnation is not compared
            inp = HeartbeatResult(inp.bootstrap, True, None, inp.health)
        original(self, inp, now, out, fired)

    return heartbeat


def _status_resurrects(original: Any) -> Any:
    def receive(self: DecodeEndpoint, inp: Any, now: float, out: Any, fired: Any) -> None:
        message = inp.message
        room = getattr(message, "room", None)
        if room is not None and room not in self.rooms and hasattr(message, "status"):
            # A late status re-creates the room it names, as a status table keyed by room would.
            self.rooms[room] = ReceiverRoom(room, message.generation, self.me, now)
        original(self, inp, now, out, fired)

    return receive


def _rows_swapped(table: Table[Any], field: str, name: str, make: Callable[[Any], Any]) -> Patch:
    """A patch of a table whose rows hold their guards and actions by reference: every row
    naming ``name`` (a guard or action, as the spec names it) gets ``make(original)``."""
    attr = "guard_fn" if field == "guard" else "action_fn"

    def swap(cells: dict[tuple[str, str], tuple[Row[Any], ...]]) -> Any:
        return {
            key: tuple(
                dataclasses.replace(r, **{attr: make(getattr(r, attr))})
                if getattr(r, field) == name
                else r
                for r in rows
            )
            for key, rows in cells.items()
        }

    return (table, "_cells", swap)


def _row_retargeted(table: Table[Any], source: str, on: str, target: Any,
                    emits: tuple[str, ...], action: Callable[..., Any]) -> Patch:  # fmt: skip
    """A patch of a table: its ``source --on-->`` rows go to ``target`` instead, emitting
    ``emits`` through ``action``."""

    def swap(cells: dict[tuple[str, str], tuple[Row[Any], ...]]) -> Any:
        return {
            key: tuple(
                dataclasses.replace(r, target=target, emits=frozenset(emits), action_fn=action)
                if (r.source.name, r.on) == (source, on)
                else r
                for r in rows
            )
            for key, rows in cells.items()
        }

    return (table, "_cells", swap)


def _succeed_without_aux(original: Any) -> Any:
    def succeed(self: ReceiverRoom, inp: SuccessArrived, now: float) -> list[Output]:
        return list(self._act_count_success(inp, now))  # the aux row is never stored

    return succeed


def _no_ack(original: Any) -> Any:
    def cancel(self: PrefillRoomSlot, inp: Any, now: float) -> list[Output]:
        original(self, inp, now)
        return []  # the cancel is kept, but its ACK is never sent

    return cancel


def _ack_without_cancel(original: Any) -> Any:
    def cancel(self: PrefillRoomSlot, inp: Any, now: float) -> list[Output]:
        return [self.host.ack(inp.abort)]  # ACKed, then forgotten: it opens as if never aborted

    return cancel


def _cancel_expires_at_the_bound(original: Any) -> Any:
    def unopened_full(self: PrefillRoomSlot, inp: Any, now: float) -> bool:
        if not original(self, inp, now):
            return False
        pending = self.host.pending
        oldest = next((room for room, r in pending.items() if r.parked_generation == NONE), None)
        if oldest is None:
            return True
        del pending[oldest]  # the bound holds; the oldest ACK's promise no longer does
        return False

    return unopened_full


def _never_full(original: Any) -> Any:
    def full_of_waiting(self: PrefillCompleteTable) -> bool:
        return False

    return full_of_waiting


def _never_evicts(original: Any) -> Any:
    def evict_past_cap(self: PrefillCompleteTable, now: float, fired: Any) -> None:
        return None

    return evict_past_cap


def _room_keyed_ready_table(original: Any) -> Any:
    def machine(self: PrefillCompleteTable, inp: Any) -> BootstrapRoom:
        held = self._rooms.get(inp.room, {})
        if held:  # keyed by room id only: any generation's entry answers for every generation
            return next(iter(held.values()))
        result: BootstrapRoom = original(self, inp)
        return result

    return machine


def _newer_generation_stale(original: Any) -> Any:
    def classify(self: PrefillRoomSlot) -> SlotState:
        state: SlotState = original(self)
        hosted = [r for r in self.host.rooms.values() if r.key == self.key]
        hosted += [r for (key, _), r in self.host.draining.items() if key == self.key]
        other = any(r.generation != self.generation for r in hosted)
        if state in (SlotState.ABSENT, SlotState.PARKED, SlotState.CANCELLED) and other:
            return SlotState.REMOVED  # "not the open generation": taken for a stale one
        return state

    return classify


def _late_abort_kept(original: Any) -> Any:
    def step(self: PrefillRoomSlot, inp: Any, now: float) -> Any:
        result = original(self, inp, now)
        if self.state is SlotState.REMOVED and type(inp).__name__ == "AbortArrived":
            # The answering ABORT of a cleared room is kept as an early arrival, forever.
            record = self.record
            record.cancelled = max(record.cancelled, self.generation)
            self.host.pending[self.key] = record
        return result

    return step


def _cancel_ends_when_a_later_opens(original: Any) -> Any:
    def step(self: PrefillRoomSlot, inp: Any, now: float) -> Any:
        result = original(self, inp, now)
        record = self.host.pending.get(self.key)
        opened = self.host.opened.get(self.key, NONE)
        if record is not None and record.parked_generation == NONE and (
            record.cancelled <= opened
        ):
            # A newer generation opened: the cancel is left to the opened mark, which forgetting
            # then drops, so a late open of the cancelled (older) generation reads as new.
            del self.host.pending[self.key]
        return result

    return step


def _abort_below_mark_kept_nowhere(original: Any) -> Any:
    def ack(self: PrefillRoomSlot, inp: Any, now: float) -> list[Output]:
        # ACKed and kept nowhere, as at the mark: only the mark then refuses a late open of
        # this (perhaps never opened) generation, and forgetting the mark lets it open.
        return [self.host.ack(inp.abort)]

    return ack


def _noop_fence(original: Any) -> Any:
    def fence(self: FakeTransport, decode_rank: int, writer: Any) -> int:
        return 0  # reported fenced, but the writer's writes still land (issue 12, finding 1)

    return fence


def _free_sources_on_clear(original: Any) -> Any:
    def clear(self: World, process: PrefillProcess | DecodeProcess, room: int) -> None:
        original(self, process, room)
        if isinstance(process, PrefillProcess):
            # The engine frees a cleared request's KV at once, though its writes still drain.
            for key in [k for k in process.draining_jobs if k[0] == room]:
                self.give_back_sources(process, process.draining_jobs.pop(key).src_pages)

    return clear


def _restart_closes_sessions(original: Any) -> Any:
    def heartbeat(self: DecodeEndpoint, inp: HeartbeatResult, now: float, out: list[Output],
                  fired: list[Fired]) -> None:  # fmt: skip
        info = self.topologies.get(inp.bootstrap)
        peers = instances_of(info).get(ProbeTarget(inp.bootstrap, inp.health), ()) if info else ()
        restarted = inp.ok and inp.incarnation not in (None, *(p.incarnation for p in peers))
        original(self, inp, now, out, fired)
        if restarted:  # "a restarted instance cannot write any more": no fence waited for
            for peer in peers:
                self._ledger(SessionClosed(peer), now, out, fired)

    return heartbeat


def _dead_means_cannot_write(original: Any) -> Any:
    def cannot_write(self: WriterHealth, writer: Any) -> bool:
        return writer in self.dead  # the heartbeat's verdict alone, before any fence

    return cannot_write


MUTANTS: tuple[Mutant, ...] = (
    Mutant("release_on_abort_without_ack", "sglang#35049/#32564",
           "the fence frees a failed room's pages at once, without waiting for drain ACKs",
           (_rows_swapped(PAGE_LEDGER_TABLE, "guard", "no_writer_can_land", _always(True)),)),
    Mutant("ack_before_drain", "sglang#38961",
           "an ABORT is ACKed at once even while writes of the room are still in flight",
           (_rows_swapped(SENDER_TABLE, "guard", "writes_outstanding", _always(False)),)),
    Mutant("max_status_lifts_failed", "sglang update_status(max(...))",
           "a late Success lifts a Failed receiver room to Success",
           ((ReceiverRoom, "fire", _lift_failed),)),
    Mutant("duplicate_claim_accepted", "sglang#34572 (room claimed twice)",
           "opening a room id that is open replaces the existing room",
           ((PrefillEndpoint, "_open", _accept_duplicate_claim),)),
    Mutant("ack_only_last_peer", "sglang#40645 (MLA fan-out)",
           "a drained sender ACKs only the last decode peer of the room",
           ((SenderRoom, "_ack_everyone", _ack_only_last_peer),)),
    Mutant("heartbeat_keeps_rooms", "sglang#16903",
           "a prefill instance declared lost does not fail the rooms it serves",
           ((DecodeEndpoint, "_instance_lost", _heartbeat_keeps_rooms),)),
    Mutant("chunk_offset_reused", "sglang staging chunk counted twice (#37697)",
           "every chunk is written at the first destination pages",
           (_rows_swapped(SENDER_TABLE, "action", "send_chunk", _chunk_offset_reused),)),
    Mutant("wait_clock_not_reset", "sglang#10110 (timeout clock shared)",
           "the wait budget is not restarted when the ready signal arrives",
           (_rows_swapped(RECEIVER_TABLE, "action", "restart_wait_clock", _wait_clock_not_reset),)),
    Mutant("success_one_peer_short", "sglang#21297 (rank count)",
           "a receiver succeeds with one required prefill rank still missing",
           ((ReceiverRoom, "_completes", _success_one_short),)),
    Mutant("restart_not_detected", "sglang#16903 / nixl#795",
           "a heartbeat answered by a new incarnation is taken for the old one",
           ((DecodeEndpoint, "_heartbeat", _restart_not_detected),)),
    Mutant("late_status_resurrects", "sglang#17259 (stale room slot)",
           "a status for a cleared room re-creates the room",
           ((DecodeEndpoint, "_receive", _status_resurrects),)),
    Mutant("registry_accepts_older_registration", "pdflow issue 12 finding 4 (unordered PUTs)",
           "a late registration of a superseded incarnation replaces the live one's rank",
           (_rows_swapped(REGISTRY_TABLE, "guard", "superseded", _always(False)),)),
    Mutant("readmit_before_drain", "pdflow issue 12 finding 2 (revisable verdict)",
           "a writer wrongly declared dead is readmitted as soon as it answers, before it "
           "ACKed the rooms it may still write",
           ((PageLedger, "owes_acks", _never_owes),)),
    Mutant("checksum_fails_open", "pdflow issue 12 finding 3 (unverified Success)",
           "a writer that sent no checksum is left out of the verification the decode requires",
           (_rows_swapped(RECEIVER_TABLE, "guard", "completes_without_checksum", _always(False)),),
           # Only a checksum-mismatch world (about 3%) has a writer sending none to a decode
           # that requires them; seed 111 is the first whose rooms get that far.
           first_seed=111),
    Mutant("checksum_mismatch_ignored", "silent KV corruption",
           "a failed checksum verification is taken as a pass",
           (_rows_swapped(RECEIVER_TABLE, "guard", "checksum_ok", _always(True)),)),
    Mutant("release_on_any_ack", "sglang#38961 (one ACK target per room)",
           "the first writer's ACK frees the pages though others may still write",
           (_rows_swapped(PAGE_LEDGER_TABLE, "guard", "clears_last_writer", _always(True)),)),
    Mutant("unopened_abort_not_acked", "sglang#38961 (late ABORT never ACKed)",
           "an ABORT for a room the prefill has not opened yet is never ACKed",
           (_rows_swapped(PREFILL_SLOT_TABLE, "action", "cancel", _no_ack),)),
    Mutant("cancel_before_sender_lost", "sglang#9266 (cancel lost)",
           "an ABORT for a room not opened yet is ACKed but not remembered",
           (_rows_swapped(PREFILL_SLOT_TABLE, "action", "cancel", _ack_without_cancel),)),
    Mutant("noop_fence", "pdflow#12 (close_session on the decode's own transport)",
           "the shell reports a dead writer fenced while its in-flight writes can still land",
           ((FakeTransport, "fence", _noop_fence),)),
    Mutant("sources_freed_while_draining", "prefill KV freed on abort while its transfer reads it",
           "the prefill engine frees a cleared room's source pages at once, while writes that "
           "read them still drain",
           ((World, "clear", _free_sources_on_clear),)),
    Mutant("release_before_fence", "pdflow#12 (a false heartbeat verdict frees pages)",
           "a writer declared dead counts as unable to write before it is fenced",
           ((WriterHealth, "cannot_write", _dead_means_cannot_write),)),
    Mutant("release_under_verification", "pdflow chaos finding 5 (scatter after release)",
           "a room cleared while the node verifies it frees its pages at once, under the staged "
           "scatter that still writes them",
           (_row_retargeted(PAGE_LEDGER_TABLE, "VERIFYING", "ReleaseAfterSuccess",
                            RoomPagesState.FREE, ("pages_freed",), RoomPages._act_free),)),
    Mutant("ready_table_uncapped", "review of 2026-12-06 (stray bootstraps held for the TTL)",
           "the prefill_complete ready table keeps every ownerless entry: past "
           "max_ownerless_ready_rooms a bootstrap or an early cancel still adds one",
           ((PrefillCompleteTable, "_full_of_waiting", _never_full),
            (PrefillCompleteTable, "_evict_past_cap", _never_evicts))),
    Mutant("failed_generation_blocks_next", "issue 11 bug A (room-keyed tombstone)",
           "the prefill_complete table is keyed by room id: a failed generation refuses the next",
           ((PrefillCompleteTable, "_machine", _room_keyed_ready_table),)),
    Mutant("newer_generation_taken_as_stale", "issue 11 bug B (stale_generation)",
           "while one generation is hosted, messages of a newer one are handled as stale",
           ((PrefillRoomSlot, "_classify", _newer_generation_stale),)),
    Mutant("success_before_aux_row", "sglang metadata gate (Success before the aux row landed)",
           "the decode reports Success without storing the room's aux row in its slot",
           (_rows_swapped(RECEIVER_TABLE, "action", "succeed", _succeed_without_aux),)),
    Mutant("cancel_expires_at_the_bound", "issue 11 item 2 (an expiry reopens a use-after-free)",
           "past max_pending_room_ids the oldest kept cancel is forgotten to make room",
           (_rows_swapped(PREFILL_SLOT_TABLE, "guard", "unopened_full",
                          _cancel_expires_at_the_bound),)),
    Mutant("answering_abort_kept_forever", "issue 11 bug C (early arrivals grow)",
           "the decode's ABORT answering a cleared failure is kept as a pending cancel",
           ((PrefillRoomSlot, "step", _late_abort_kept),)),
    Mutant("cancel_ends_when_a_later_generation_opens", "model checker seed 284 (forgotten mark)",
           "a cancel is dropped once a later generation opens, so an older one opens after it",
           ((PrefillRoomSlot, "step", _cancel_ends_when_a_later_opens),), first_seed=284),
    Mutant("restart_closes_sessions", "review of 2026-12-06 (a restart taken as a fence)",
           "a prefill seen restarted has its old lives' sessions taken as closed at once, though "
           "writes they handed the network before the crash may still land",
           ((DecodeEndpoint, "_heartbeat", _restart_closes_sessions),)),
    Mutant("abort_below_mark_kept_nowhere", "the stop-20 hole (model checker seed 2367)",
           "an ABORT below the opened mark is ACKed and kept nowhere: once the mark is "
           "forgotten, the engine's late open of that generation succeeds",
           (_rows_swapped(PREFILL_SLOT_TABLE, "action", "ack_below_mark",
                          _abort_below_mark_kept_nowhere),), first_seed=1537),
)  # fmt: skip


def by_name(name: str) -> Mutant:
    for mutant in MUTANTS:
        if mutant.name == name:
            return mutant
    raise KeyError(f"no mutant named {name!r}; known: {', '.join(m.name for m in MUTANTS)}")
