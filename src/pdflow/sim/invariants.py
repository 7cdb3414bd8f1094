"""The protocol's invariants, checked after every step of a simulated world.

Safety (every step): KVPoll monotone per room instance, Failed absorbing, terminal sticky; no
message creates or revives a room; no status after a room was cleared; at most one terminal
outcome per room instance and side; a decode Success agrees with its writers' outcomes and the
pages hold exactly the bytes they sent; no write lands in a page its room instance does not own,
nor reads a prefill source page its room instance no longer holds;
admission never promises pages the ledger holds and never deadlocks; a decode that requires
checksums never succeeds unverified; the registry never names a superseded incarnation.

Liveness (:func:`check_quiescent`, after :func:`settle`): every room terminal and cleared, no
outstanding write, the decode pool whole except for quarantine that a lost control message
explains (such pages stay quarantined and reported, never released by a timer), and no live
prefill incarnation still declared dead (a false heartbeat verdict is lifted once the writer
answers and drains), except where a lost ABORT or ACK explains it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    CloseSession,
    Dropped,
    OpenReceiver,
    OpenRoom,
    Received,
    RoomCall,
    TopologyKnown,
)
from pdflow.core.endpoints.opened_marks import NONE
from pdflow.core.framework.kvpoll import KVPoll, poll_may_follow
from pdflow.core.framework.step import Step
from pdflow.core.framework.table import Fired
from pdflow.core.protocol.inputs import SendChunk
from pdflow.core.protocol.messages import Abort, AbortAck, PeerId, RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import SendMessage, StartTransfer, StatusChanged
from pdflow.core.resources.page_ledger import RoomPagesState
from pdflow.core.rooms.prefill_complete import BootstrapRoomState
from pdflow.sim.transport import aux_content, source_content

if TYPE_CHECKING:
    from pdflow.sim.engine import DecodeProcess, PrefillProcess
    from pdflow.sim.world import World

Transition = tuple[str, str, str, str | None, str]
OWNERLESS_READY_STATES = (BootstrapRoomState.UNOWNED.name, BootstrapRoomState.TOMBSTONE.name)
"""The ready table's states no sender owns (a snapshot names its entries' states)."""
MISMATCH_DECLARED = "checksum mismatch"
"""How a decode that requires checksums fails rooms of a prefill registered without them."""
MISMATCH_UNDECLARED = "KV checksum missing"
"""How it fails a room whose writers all reported Success without one."""
"""(machine, from, on, guard, to): one spec row."""

INVARIANTS = (
    "kvpoll_monotone",
    "failed_absorbing",
    "terminal_sticky",
    "one_terminal_outcome",
    "no_resurrection",
    "no_status_after_clear",
    "duplicate_claim_fails",
    "refusal_changes_nothing",
    "success_needs_all_peers",
    "sides_agree",
    "success_bytes_exact",
    "checksums_fail_closed",
    "aux_before_success",
    "chunks_partition",
    "drain_before_ack",
    "abort_is_final",
    "fence_before_abort",
    "no_use_after_free",
    "no_source_use_after_free",
    "single_room_status_clock",
    "lost_instance_fails_rooms",
    "admission_consistent",
    "admission_no_deadlock",
    "registry_ordered",
    "newer_generation_not_stale",
    "generation_isolation",
    "bounded_room_state",
    "no_core_error",
    "rooms_settle",
    "verdict_revisable",
    "pages_return",
)
"""The ids of spec/protocol.toml's [[invariants]], each checked here (or by the World, through
:meth:`Monitor.fail`); `pdflow spec check` fails when the two lists differ."""


class InvariantViolation(AssertionError):
    """A simulated world broke a protocol invariant; the message lists every violation."""


class Monitor:
    def __init__(self, world: World) -> None:
        self.world = world
        self.violations: list[str] = []
        self.polls: dict[tuple[str, int, int], KVPoll] = {}
        self.outcomes: dict[tuple[str, int, int], KVPoll] = {}
        self.prefill_outcomes: dict[tuple[PeerId, int, int], KVPoll] = {}
        self.removed: set[tuple[str, int, int]] = set()
        self.changed_at: dict[tuple[str, int, int], float] = {}
        self.coverage: Counter[Transition] = Counter()
        self.opened: dict[tuple[str, int], int] = {}
        """(prefill process, room id) -> the highest generation the engine opened there."""
        self.cancelled: dict[tuple[str, int], int] = {}
        """(prefill process, room id) -> the highest generation an ABORT was delivered for."""
        self.chunks: dict[tuple[str, int, int], tuple[int, int]] = {}
        """(prefill process, room, generation) -> (pages sent in chunks, chunks marked last)."""
        self.acked_unopened: set[tuple[str, int, int]] = set()
        self.opened_generations: set[tuple[str, int, int]] = set()
        """(prefill process, room, generation) the engine opened there, every one."""
        self.acked_off_mark: set[tuple[str, int, int]] = set()
        """ACKs of a generation not hosted and not the rank's opened mark (above it, below it, or
        its mark forgotten): the rank cannot tell whether it opened that one, so it keeps a
        cancel for it (bounded_room_state allows it)."""
        self.acks_owed: dict[tuple[str, int, int], set[PeerId]] = {}
        """(prefill process, room, generation) -> decode peers whose ABORT it took and has not
        ACKed yet (drain_before_ack: owed only while the room still has writes in flight)."""
        """Room instances a prefill ACKed an ABORT for while it hosted no room of them."""
        self.checked: Counter[str] = Counter()
        """How many times each invariant was evaluated here (:meth:`checking`)."""
        self._reported_uaf = 0
        self._reported_source_reads = 0

    # ---- recording -------------------------------------------------------------------------------
    def fail(self, invariant: str, message: str) -> None:
        """Record a violation of the spec invariant with this id."""
        if invariant not in INVARIANTS:
            raise ValueError(f"{invariant!r} is not an invariant of spec/protocol.toml")
        self.violations.append(f"t={self.world.clock.now:g}: [{invariant}] {message}")

    def checking(self, *invariants: str) -> None:
        """Count one evaluation of each of these invariants: call it where the check runs."""
        self.checked.update(invariants)

    @property
    def counts(self) -> Counter[str]:
        """How many times each invariant was evaluated so far, the transport's check of every
        page a write landed in or read from included."""
        transport = self.world.transport
        return self.checked + Counter(
            no_use_after_free=transport.pages_checked,
            no_source_use_after_free=transport.sources_checked,
        )

    @property
    def checks(self) -> int:
        """Invariant evaluations so far, every id counted each time its check ran."""
        return sum(self.counts.values())

    def record_fired(self, fired: tuple[Fired, ...]) -> None:
        for f in fired:
            self.coverage[(f.machine, f.source, f.on, f.guard, f.target)] += 1

    def assert_ok(self) -> None:
        if self.violations:
            raise InvariantViolation("\n".join(self.violations))

    # ---- per step ----------------------------------------------------------------------------
    def observe(
        self,
        process: PrefillProcess | DecodeProcess,
        inp: AnyEndpointInput,
        step: Step,
        before: set[int],
    ) -> None:
        self.record_fired(step.fired)
        name = process.name
        allowed = set(before)
        if isinstance(inp, (OpenRoom, OpenReceiver)):
            allowed.add(inp.room)
            self.polls[(name, inp.room, inp.generation)] = KVPoll.Bootstrapping
            self.changed_at[(name, inp.room, inp.generation)] = self.world.clock.now
        created = set(process.endpoint.rooms) - allowed
        self.checking("no_resurrection")
        if created:
            self.fail(
                "no_resurrection", f"{name}: {type(inp).__name__} created rooms {sorted(created)}"
            )
        for output in step.outputs:
            if isinstance(output, StatusChanged):
                self._status(process, output)
                self._check_mismatch_reason(process, inp, output)
        if process.endpoint.role == "prefill":
            self._check_generations(process, inp, step)  # type: ignore[arg-type]
            self._check_sender(process, inp, step)  # type: ignore[arg-type]
            self._check_bounded(process)  # type: ignore[arg-type]
        self.check_writes()
        if process.endpoint.role == "decode":
            self._check_admission(process)  # type: ignore[arg-type]
            self._check_lost_writers(process, step)  # type: ignore[arg-type]
            self._check_fence_before_abort(process, step)  # type: ignore[arg-type]

    def _status(self, process: PrefillProcess | DecodeProcess, change: StatusChanged) -> None:
        key = (process.name, change.room, change.generation)
        self.checking("no_status_after_clear")
        if key in self.removed:
            self.fail(
                "no_status_after_clear",
                f"{process.name}: room {change.room}/{change.generation} changed status "
                f"to {change.poll.name} after it was cleared",
            )
            return
        previous = self.polls.get(key)
        if previous is None:
            self.fail(
                "no_resurrection",
                f"{process.name}: status for room {change.room}/{change.generation}, "
                "which was never opened",
            )
            return
        self._check_timeout(process, change, key)
        # One check, three invariants: no status may follow Failed or Success, nor go back.
        self.checking("kvpoll_monotone", "failed_absorbing", "terminal_sticky")
        if not poll_may_follow(previous, change.poll):
            broken = (
                "failed_absorbing" if previous is KVPoll.Failed
                else "terminal_sticky" if previous is KVPoll.Success
                else "kvpoll_monotone"
            )  # fmt: skip
            self.fail(
                broken,
                f"{process.name}: room {change.room}/{change.generation} went "
                f"{previous.name} -> {change.poll.name}",
            )
        self.polls[key] = change.poll
        self.changed_at[key] = self.world.clock.now
        if not change.poll.is_terminal:
            return
        earlier = self.outcomes.get(key)
        self.checking("one_terminal_outcome")
        if earlier is not None and earlier is not change.poll:
            self.fail(
                "one_terminal_outcome",
                f"{process.name}: room {change.room}/{change.generation} had two "
                f"terminal outcomes, {earlier.name} then {change.poll.name}",
            )
        self.outcomes[key] = change.poll
        if process.endpoint.role == "prefill":
            self.prefill_outcomes[(process.me, change.room, change.generation)] = change.poll

    def _check_mismatch_reason(
        self, process: PrefillProcess | DecodeProcess, inp: AnyEndpointInput, change: StatusChanged
    ) -> None:
        """In a checksum-mismatch world, a decode room the mismatch fails is told so: by its
        prefill's registration (declared), or by its writers' Successes without a checksum."""
        if not self.world.shape.checksum_mismatch or process.endpoint.role != "decode":
            return
        if change.poll is not KVPoll.Failed:
            return
        if isinstance(inp, TopologyKnown) and inp.info.checksum is False:
            expected = MISMATCH_DECLARED
        elif (
            isinstance(inp, Received)
            and isinstance(inp.message, StatusReport)
            and inp.message.status is KVPoll.Success
        ):
            expected = MISMATCH_UNDECLARED
        else:
            return  # failed before the mismatch could show (an abort, a timeout, a crash)
        self.checking("checksums_fail_closed")
        if not change.reason.startswith(expected):
            self.fail(
                "checksums_fail_closed",
                f"{process.name}: room {change.room}/{change.generation} of a checksum-mismatch "
                f"world failed with {change.reason!r}, not {expected!r}",
            )

    def _check_timeout(
        self,
        process: PrefillProcess | DecodeProcess,
        change: StatusChanged,
        key: tuple[str, int, int],
    ) -> None:
        """A timeout fires no earlier than its budget after the room's last status change (every
        budget is (re)armed at or after one)."""
        prefill = process.endpoint.role == "prefill"
        own = (
            ("waiting for decode metadata",)
            if prefill
            else ("waiting for the prefill", "waiting for the transfer")
        )
        reason = change.reason
        if not reason.startswith("timed out after") or not any(t in reason for t in own):
            return  # not a timeout, or a peer's timeout relayed in its failure reason
        shape = self.world.shape
        budget = shape.bootstrap_timeout if prefill else shape.waiting_timeout
        waited = self.world.clock.now - self.changed_at[key]
        self.checking("single_room_status_clock")
        if waited < budget:
            self.fail(
                "single_room_status_clock",
                f"{process.name}: room {change.room}/{change.generation} timed out after "
                f"{waited:g}s in {self.polls[key].name}, budget {budget:g}s",
            )

    def _check_generations(
        self, process: PrefillProcess, inp: AnyEndpointInput, step: Step
    ) -> None:
        """One generation of a room id never decides for another, and a rank keeps nothing
        for a generation it has finished."""
        name = process.name
        if isinstance(inp, Received) and isinstance(inp.message, (RoomMetadata, Abort)):
            message = inp.message
            key = (name, message.room)
            if isinstance(message, Abort):
                self.cancelled[key] = max(self.cancelled.get(key, message.generation),
                                          message.generation)  # fmt: skip
            stale = [o for o in step.outputs
                     if isinstance(o, Dropped) and o.kind == "stale_generation"]  # fmt: skip
            opened = self.opened.get(key)
            self.checking("newer_generation_not_stale")
            if stale and (opened is None or message.generation > opened):
                self.fail(
                    "newer_generation_not_stale",
                    f"{name}: {type(message).__name__} for room {message.room}/"
                    f"{message.generation} dropped as stale, but the highest generation opened "
                    f"there is {opened}",
                )
        if isinstance(inp, OpenRoom) and inp.room in process.endpoint.rooms:
            key = (name, inp.room)
            self.opened[key] = max(self.opened.get(key, inp.generation), inp.generation)
            self.opened_generations.add((name, inp.room, inp.generation))
            failed = any(isinstance(o, StatusChanged) and o.poll is KVPoll.Failed
                         for o in step.outputs)  # fmt: skip
            self.checking("generation_isolation", "abort_is_final")
            if failed and self.cancelled.get(key, inp.generation - 1) < inp.generation:
                self.fail(
                    "generation_isolation",
                    f"{name}: room {inp.room}/{inp.generation} failed as it opened, but no "
                    "ABORT for that generation (or a later one) ever reached this rank",
                )
            # An ACK promises its own generation never writes (the core's floor is stricter).
            promised = [g for (owner, room, g) in self.acked_unopened
                        if (owner, room) == key and g == inp.generation]  # fmt: skip
            if promised and not failed:
                self.fail(
                    "abort_is_final",
                    f"{name}: room {inp.room}/{inp.generation} opened without failing, though "
                    f"this rank ACKed an ABORT for generation {max(promised)} before it opened",
                )

    def _check_bounded(self, process: PrefillProcess) -> None:
        """bounded_room_state, after the step's ACKs are counted (one may keep a cancel)."""
        name = process.name
        endpoint = process.endpoint
        self.checking("bounded_room_state")
        self._check_ready_table_bounded(process)
        for room, record in endpoint.pending.items():
            parked = record.parked_generation != NONE
            if parked or record.cancelled > endpoint.opened.get(room, NONE):
                continue
            # A cancel at or below the opened mark is kept only for an ABORT this rank ACKed
            # while it could not tell it had opened that generation (not the one at its mark):
            # an older one may still open after a newer one.
            backed = any((owner, key) == (name, room) and g <= record.cancelled
                         for (owner, key, g) in self.acked_unopened | self.acked_off_mark)
            if not backed:
                self.fail(
                    "bounded_room_state",
                    f"{name}: room {room} keeps a cancel for generation {record.cancelled}, "
                    "which it opened already and ACKed no ABORT for before it opened "
                    "(state that grows with failures)",
                )

    def _check_ready_table_bounded(self, process: PrefillProcess) -> None:
        """bounded_room_state's prefill_complete part: the ready table's entries no sender owns,
        counted from its snapshot (not from the table's own count, which a bug could skew)."""
        table = process.endpoint.ready_table
        if table is None:
            return
        cap = process.endpoint.config.max_ownerless_ready_rooms
        ownerless = sum(entry.state in OWNERLESS_READY_STATES for entry in table.snapshot().rooms)
        if ownerless > cap:
            self.fail(
                "bounded_room_state",
                f"{process.name}: the ready table holds {ownerless} entries no sender owns, over "
                f"max_ownerless_ready_rooms={cap} (stray bootstraps and early cancels held for "
                "the whole TTL)",
            )

    def _check_sender(self, process: PrefillProcess, inp: AnyEndpointInput, step: Step) -> None:
        """chunks_partition, drain_before_ack and abort_is_final, from what the sender did."""
        name, endpoint = process.name, process.endpoint
        self._check_acks_owed(process, inp, step)
        if isinstance(inp, RoomCall) and isinstance(inp.call, SendChunk):
            generation = endpoint.generation_of(inp.room)
            if generation is not None:
                key = (name, inp.room, generation)
                pages, lasts = self.chunks.get(key, (0, 0))
                self.chunks[key] = (pages + len(inp.call.src_pages), lasts + inp.call.is_last)
        for output in step.outputs:
            if isinstance(output, StatusChanged) and output.poll is KVPoll.Success:
                room = endpoint.rooms.get(output.room)
                key = (name, output.room, output.generation)
                sent = self.chunks.get(key, (0, 0))
                self.checking("chunks_partition")
                if room is not None and sent != (room.num_pages, 1):
                    self.fail(
                        "chunks_partition",
                        f"{name}: room {output.room}/{output.generation} succeeded after chunks "
                        f"of {sent[0]} pages ({sent[1]} marked last), num_pages={room.num_pages}",
                    )
            elif isinstance(output, StartTransfer):
                self.checking("abort_is_final")
                if (name, output.room, output.generation) in self.acked_unopened:
                    self.fail(
                        "abort_is_final",
                        f"{name}: room {output.room}/{output.generation} writes after it ACKed "
                        "an ABORT for it before it opened",
                    )
            elif isinstance(output, SendMessage) and isinstance(output.message, AbortAck):
                ack = output.message
                pending = [w.wid for w in self.world.transport.writes.values()
                           if w.writer == process.me
                           and (w.room, w.generation) == (ack.room, ack.generation)]  # fmt: skip
                self.checking("drain_before_ack")
                if pending:
                    self.fail(
                        "drain_before_ack",
                        f"{name}: ACKed room {ack.room}/{ack.generation} with writes {pending} "
                        "still outstanding",
                    )
                hosted = endpoint.generation_of(ack.room) == ack.generation or (
                    endpoint.is_draining(ack.room, ack.generation)
                )
                key = (name, ack.room, ack.generation)
                if not hosted and key not in self.opened_generations:
                    self.acked_unopened.add(key)
                if not hosted and ack.generation != endpoint.opened.get(ack.room, NONE):
                    self.acked_off_mark.add(key)

    def _check_acks_owed(self, process: PrefillProcess, inp: AnyEndpointInput, step: Step) -> None:
        """drain_before_ack, its other half: an ABORT the prefill took is ACKed in the step its
        room has no write left in flight (at once, when none was), not on a later duplicate."""
        name = process.name
        if isinstance(inp, Received) and isinstance(inp.message, Abort):
            abort = inp.message
            if not any(isinstance(o, Dropped) for o in step.outputs):
                self.acks_owed.setdefault((name, abort.room, abort.generation), set()).add(
                    abort.decode
                )
        for output in step.outputs:
            if isinstance(output, SendMessage) and isinstance(output.message, AbortAck):
                ack = output.message
                owed = self.acks_owed.get((name, ack.room, ack.generation))
                if owed is not None:
                    owed.discard(ack.decode)
        for key in [k for k, owed in self.acks_owed.items() if k[0] == name and not owed]:
            del self.acks_owed[key]
        in_flight = {(w.room, w.generation) for w in self.world.transport.writes.values()
                     if w.writer == process.me}  # fmt: skip
        self.checking("drain_before_ack")
        for (owner, room, generation), owed in sorted(self.acks_owed.items()):
            if owner == name and (room, generation) not in in_flight:
                self.fail(
                    "drain_before_ack",
                    f"{name}: room {room}/{generation} has no write in flight but never ACKed "
                    f"the ABORT of {sorted(p.address for p in owed)}",
                )

    def _check_fence_before_abort(self, process: DecodeProcess, step: Step) -> None:
        ledger = process.endpoint.ledger
        for output in step.outputs:
            if isinstance(output, SendMessage) and isinstance(output.message, Abort):
                abort = output.message
                self.checking("fence_before_abort")
                if ledger.state_of(abort.room, abort.generation) is RoomPagesState.RESERVED:
                    self.fail(
                        "fence_before_abort",
                        f"{process.name}: ABORT for room {abort.room}/{abort.generation} sent "
                        "while its published pages are not fenced",
                    )

    def _check_lost_writers(self, process: DecodeProcess, step: Step) -> None:
        """Once a writer is declared dead, no room still counts on it."""
        dead = {o.peer for o in step.outputs if isinstance(o, CloseSession)}
        if not dead:
            return
        self.checking("lost_instance_fails_rooms")
        for room_id, room in sorted(process.endpoint.rooms.items()):
            verifying = room.state.name == "VERIFYING"  # every writer already finished
            if (
                not room.poll.is_terminal
                and not verifying
                and dead & {t.peer for t in room.targets}
            ):
                self.fail(
                    "lost_instance_fails_rooms",
                    f"{process.name}: room {room_id}/{room.generation} still "
                    f"{room.poll.name} after its prefill instance was declared lost",
                )

    def room_removed(self, process: PrefillProcess | DecodeProcess, room: int, gen: int) -> None:
        self.removed.add((process.name, room, gen))

    def check_writes(self) -> None:
        """Report each use-after-free the transport saw since the last check: a write into a
        decode page, or out of a prefill source page, its room instance did not hold."""
        transport = self.world.transport
        for uaf in transport.violations[self._reported_uaf :]:
            self.fail("no_use_after_free", f"use-after-free: {uaf.describe()}")
        self._reported_uaf = len(transport.violations)
        for read in transport.source_violations[self._reported_source_reads :]:
            self.fail("no_source_use_after_free", f"source read after free: {read.describe()}")
        self._reported_source_reads = len(transport.source_violations)

    def _check_admission(self, process: DecodeProcess) -> None:
        admission = process.admission
        allocatable = process.endpoint.ledger.allocatable
        self.checking("admission_consistent")
        if allocatable < admission.free_pages:
            self.fail(
                "admission_consistent",
                f"{process.name}: admission counts {admission.free_pages} free pages but "
                f"the ledger can hand out only {allocatable}",
            )
        if admission.queue and not admission.admitted:
            head = next(iter(admission.queue.values()))
            decision = admission.decide(head)
            self.checking("admission_no_deadlock")
            if not decision.admit:
                self.fail(
                    "admission_no_deadlock",
                    f"{process.name}: admission deadlock: nothing admitted, yet the head "
                    f"is refused ({decision.reason})",
                )

    def decode_succeeded(self, process: DecodeProcess, room_id: int) -> None:
        room = process.endpoint.rooms[room_id]
        job = process.jobs[room_id]
        gen = room.generation
        writers = self.world.writers_of(process.rank, room_id)
        unverified = [p.address for p, checksum in room.succeeded.items() if checksum is None]
        self.checking("success_needs_all_peers")
        if process.endpoint.config.verify_checksums:
            self.checking("checksums_fail_closed")
        if process.endpoint.config.verify_checksums and unverified:
            self.fail(
                "checksums_fail_closed",
                f"{process.name}: room {room_id}/{gen} succeeded unverified: checksums are "
                f"required but {unverified} sent none",
            )
        if len(room.succeeded) < len(writers):
            self.fail(
                "success_needs_all_peers",
                f"{process.name}: room {room_id}/{gen} succeeded with "
                f"{len(room.succeeded)} of {len(writers)} writers",
            )
        published = room.published
        with_aux = published is not None and published.aux_index is not None
        if with_aux:
            self.checking("aux_before_success")
        if with_aux and job.aux != aux_content(room_id, gen):
            self.fail(
                "aux_before_success",
                f"{process.name}: room {room_id}/{gen} succeeded but its aux slot holds "
                f"{job.aux!r}, not the room's aux row",
            )
        for peer in room.succeeded:
            outcome = self.prefill_outcomes.get((peer, room_id, gen))
            self.checking("sides_agree", "success_bytes_exact")
            if outcome is not KVPoll.Success:
                self.fail(
                    "sides_agree",
                    f"{process.name}: room {room_id}/{gen} succeeded but its writer "
                    f"{peer.address} is {outcome.name if outcome else 'without outcome'}",
                )
            segment = writers.index(peer.rank)
            for index in range(job.request.num_pages):
                page = job.pages[index]
                landed = self.world.transport.read_segment(process.rank, page, segment)
                if landed != source_content(room_id, gen, peer.rank, index):
                    self.fail(
                        "success_bytes_exact",
                        f"{process.name}: room {room_id}/{gen} succeeded but page {page} "
                        f"holds wrong bytes from {peer.address} (page {index})",
                    )
                    return


def explained_quarantine(world: World, decode_rank: int, room: int, gen: int) -> bool:
    """A room still fenced after settling is fine only if an ABORT or its ACK was lost (or the
    ABORT refused past the prefill's max_pending_room_ids, which is not ACKed either), or,
    without a receiver-side fence, if every writer it waits on is a process life that ended
    (it will never ACK, and nothing proves its writes cannot land)."""
    if not world.shape.receiver_fence:
        ledger = world.decode[decode_rank].endpoint.ledger
        held = {(q.room, q.generation): q.waiting_on for q in ledger.report(world.clock.now)}
        live = {world.prefill_peer(rank) for rank in range(world.shape.prefill_ranks)}
        if (room, gen) in held and not live.intersection(held[(room, gen)]):
            return True
    address = world.decode[decode_rank].me.address
    for refused in world.refused_aborts:
        if (refused.room, refused.generation) == (room, gen) and refused.decode.address == address:
            return True
    for envelope in world.network.lost:
        message = envelope.message
        if (
            isinstance(message, (Abort, AbortAck))
            and (message.room, message.generation) == (room, gen)
            and message.decode.address == address
        ):
            return True
    return False


def explained_verdict(world: World, decode_rank: int, peers: tuple[PeerId, ...]) -> bool:
    """A live writer may stay declared dead after settling only if an ABORT to it or its ACK
    was lost, or the ABORT was refused past the prefill's max_pending_room_ids (not ACKed
    either, as :func:`explained_quarantine` counts it): then it owes an ACK the decode can
    never receive."""
    address = world.decode[decode_rank].me.address
    writers = {p.address for p in peers}
    unanswered = [e.message for e in world.network.lost] + list(world.refused_aborts)
    return any(
        isinstance(message, (Abort, AbortAck))
        and message.decode.address == address
        and message.prefill.address in writers
        for message in unanswered
    )


def check_quiescent(world: World) -> list[str]:
    """Liveness (rooms_settle, pages_return), once the world has settled: what is still held,
    open or outstanding; each problem starts with the invariant's id."""
    problems: list[str] = []
    world.monitor.checking("rooms_settle", "pages_return", "verdict_revisable")
    for process in world.processes():
        rooms = process.endpoint.rooms
        for room_id in sorted(rooms):
            room = rooms[room_id]
            problems.append(
                f"[rooms_settle] {process.name}: room {room_id}/{room.generation} still open in "
                f"{room.state.name} after settling"
            )
    for p in world.prefill:
        if p.endpoint.outstanding_writes:
            problems.append(
                f"[rooms_settle] {p.name}: {p.endpoint.outstanding_writes} writes still outstanding"
            )
    for d in world.decode:
        ledger = d.endpoint.ledger
        report = {(q.room, q.generation): q for q in ledger.report(world.clock.now)}
        for held in ledger.snapshot().rooms:
            key = (held.room, held.generation)
            if key not in report:
                problems.append(
                    f"[pages_return] {d.name}: room {key[0]}/{key[1]} still holds pages "
                    f"{held.pages} in {held.state}"
                )
            elif not explained_quarantine(world, d.rank, *key):
                problems.append(
                    f"[pages_return] {d.name}: room {key[0]}/{key[1]} pages {held.pages} stay "
                    f"quarantined waiting on {report[key].waiting_on}, no message lost"
                )
        quarantined = {key for key in report if explained_quarantine(world, d.rank, *key)}
        stuck = [
            rid
            for rid in d.admission.admitted
            if tuple(int(x) for x in rid.split("/")) not in quarantined
        ]
        if stuck:
            problems.append(f"[pages_return] {d.name}: admitted requests never finished: {stuck}")
        for lost in d.endpoint.lost.values():
            live = world.prefill_incarnation in lost.incarnations
            if live and not explained_verdict(world, d.rank, lost.peers):
                owing = [p.address for p in lost.peers if d.endpoint.ledger.owes_acks(p)]
                problems.append(
                    f"[verdict_revisable] {d.name}: live prefill incarnation "
                    f"{world.prefill_incarnation} is still "
                    f"declared dead after settling (answered: {lost.answered}, owes drain "
                    f"ACKs: {owing}), no message lost"
                )
    for (name, room_id, gen), poll in world.monitor.polls.items():
        if not poll.is_terminal and world.is_live(name):
            problems.append(
                f"[rooms_settle] {name}: room {room_id}/{gen} never reached a terminal outcome"
            )
    return problems
