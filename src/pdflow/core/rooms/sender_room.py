"""SenderRoom: one room on one prefill rank, from the first metadata to a terminal poll.

The prefill learns where to write from ``RoomMetadata`` sent by ``required_dst_info_num`` distinct
decode ranks, then the engine feeds page chunks in order. A failure stops new writes at once,
but the room only becomes quiescent (``FAILED``) when every write already started has
completed: only then may the prefill ACK an abort, because only then can the decode safely
reuse the pages. See spec/protocol.toml ``[machines.SenderRoom]``.
"""

from __future__ import annotations

import enum
from itertools import chain
from typing import Any

from pdflow.core.dataplane.checksum import ROOM_FOLD_MODULUS
from pdflow.core.framework.dispatch import remembered_kind
from pdflow.core.framework.errors import InvalidInput, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.table import STATUS_CHANGED, Table, TableMachine, row
from pdflow.core.protocol.inputs import (
    AbortArrived,
    AbortRequested,
    InitTransfer,
    Input,
    MetadataArrived,
    PrefillCompleted,
    SendChunk,
    Tick,
    TransferCompleted,
)
from pdflow.core.protocol.messages import (
    AbortAck,
    PeerId,
    RoomMetadata,
    StatusReport,
    peer_order,
    wire_int_refusal,
)
from pdflow.core.protocol.outputs import Output, SendMessage, StartTransfer
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts


class SenderState(enum.Enum):
    BOOTSTRAPPING = "BOOTSTRAPPING"
    WAITING_FOR_INPUT = "WAITING_FOR_INPUT"
    TRANSFERRING = "TRANSFERRING"
    SUCCESS = "SUCCESS"
    DRAINING = "DRAINING"
    FAILED = "FAILED"


SENDER_POLL = {
    SenderState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    SenderState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    SenderState.TRANSFERRING: KVPoll.Transferring,
    SenderState.SUCCESS: KVPoll.Success,
    SenderState.DRAINING: KVPoll.Failed,
    SenderState.FAILED: KVPoll.Failed,
}
_POLL_BY_NAME = {state.name: poll for state, poll in SENDER_POLL.items()}
# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_BOOTSTRAPPING = SenderState.BOOTSTRAPPING
_WAITING_FOR_INPUT = SenderState.WAITING_FOR_INPUT
_TAKING_CHUNKS = (SenderState.WAITING_FOR_INPUT, SenderState.TRANSFERRING)
_EARLY = AllocationPolicy.EARLY
_VALIDATED: frozenset[type] = frozenset({MetadataArrived, InitTransfer, SendChunk, AbortArrived})
_VALIDATED_KIND: dict[type, type] = {}
"""Each input class seen by ``_validate``, mapped to the listed type it is an instance of."""
_POLL_SUCCESS = KVPoll.Success

_S = SenderState
_STATUS = "send.status"
_ACK = "send.abort_ack"
_CHANGED = STATUS_CHANGED
_START = "start_transfer"


class SenderRoom(TableMachine[SenderState]):
    """One room on one prefill rank. Drive it with :meth:`handle`."""

    table: Table[SenderState]

    def __init__(
        self,
        room: int,
        generation: int,
        me: PeerId,
        now: float,
        *,
        policy: AllocationPolicy = AllocationPolicy.EARLY,
        timeouts: Timeouts = Timeouts(),  # noqa: B008 - immutable
    ) -> None:
        self.key = room
        self.generation = generation
        self.me = me
        self.policy = policy
        self.timeouts = timeouts
        self.state = SENDER_TABLE.initial
        self.peers: dict[PeerId, RoomMetadata] = {}
        self.required_dst: int | None = None
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.aux_rows: dict[PeerId, bytes] = {}
        """Each peer's aux row, as the shell read it after that peer's last chunk."""
        self.next_page = 0
        self.last_submitted = False
        self.outstanding: dict[int, PeerId] = {}
        self.next_seq = 0
        self.acks_owed: set[PeerId] = set()
        self.checksums: dict[PeerId, int | None] = {}
        self.reason = ""
        self.bootstrap_deadline: float | None = (
            now + timeouts.bootstrap_timeout if policy is _EARLY else None
        )

    # ---- public API ----------------------------------------------------------------------------
    @property
    def poll(self) -> KVPoll:
        return _POLL_BY_NAME[self.state._name_]  # str keys: Enum hashing runs in Python

    @property
    def quiescent(self) -> bool:
        """No write of this room can still land anywhere."""
        return not self.outstanding

    @property
    def decode_prefix_len(self) -> int:
        """Tokens the decode already holds (its cached prefix): the engine sends only the pages
        after them (``planning.partition_chunks``); 0 until a writing peer's metadata came."""
        writers = [md for md in self.peers.values() if not md.is_dummy]
        return writers[0].decode_prefix_len if writers else 0

    def timer_at(self) -> float | None:
        return self.bootstrap_deadline if self.state is _BOOTSTRAPPING else None

    # ---- validation: raise before anything changes -------------------------------------------
    def _validate(self, inp: Input, now: float) -> None:
        # Compared by type with ``is`` (framework/dispatch.py): most inputs match none.
        kind = _VALIDATED_KIND.get(type(inp))
        if kind is None:
            kind = remembered_kind(inp, _VALIDATED, _VALIDATED_KIND)
        given: Any = inp  # typed again in each branch: ``kind is X`` does not narrow ``inp``
        if kind is MetadataArrived:
            metadata: MetadataArrived = given
            self._validate_metadata(metadata.metadata)
        elif kind is InitTransfer:
            self._validate_init(given)
        elif kind is SendChunk:
            self._validate_chunk_arguments(given)
            if self._chunk_expected():
                self._validate_chunk(given)
        elif kind is AbortArrived:
            abort: AbortArrived = given
            if abort.abort.room != self.key or abort.abort.generation != self.generation:
                raise RemoteProtocolError(f"abort for room {abort.abort.room} routed to {self.key}")

    def _validate_metadata(self, md: RoomMetadata) -> None:
        if md.room != self.key or md.generation != self.generation:
            raise RemoteProtocolError(
                f"metadata for room {md.room}/{md.generation} routed to {self.key}/"
                f"{self.generation}"
            )
        if md.required_dst_info_num < 1:
            raise RemoteProtocolError("required_dst_info_num must be at least 1")
        if md.decode_prefix_len < 0:
            raise RemoteProtocolError(f"decode_prefix_len must be >= 0, got {md.decode_prefix_len}")
        # Whether it agrees with the peers so far, or is one too many, depends on the room's
        # state: guards (peer_agrees, peer_fits) decide, and _why_refused explains.

    def _validate_init(self, inp: InitTransfer) -> None:
        # The arguments themselves are refused in every state that takes the call (a failed
        # room ignores the call, not a caller bug); what the peers published is checked only
        # for the first InitTransfer (a second one is refused by the table: guard first_init).
        refusal = wire_int_refusal("num_pages", inp.num_pages) or wire_int_refusal(
            "aux_index", () if inp.aux_index is None else inp.aux_index
        )
        if refusal is not None:
            raise InvalidInput(f"room {self.key}: {refusal}")
        if self.state is not _WAITING_FOR_INPUT or self.num_pages is not None:
            return
        for md in self.peers.values():
            if md.aux_index is not None and not md.is_dummy and inp.aux_index is None:
                raise InvalidInput(
                    f"room {self.key}: decode peer {md.decode.address} expects an aux row "
                    f"(its aux slot {md.aux_index}); pass the room's aux_index to init_transfer"
                )
        for md in self.peers.values():
            if not md.is_dummy and len(md.dst_pages) < inp.num_pages:
                raise InvalidInput(
                    f"room {self.key}: {inp.num_pages} pages to send but decode peer "
                    f"{md.decode.address} published only {len(md.dst_pages)}; "
                    "send fewer pages (check decode_prefix_len) or abort the room"
                )

    def _chunk_expected(self) -> bool:
        """InitTransfer was called and the last chunk not sent yet (states that take chunks)."""
        taking = self.state in _TAKING_CHUNKS
        return taking and self.num_pages is not None and not self.last_submitted

    def _validate_chunk_arguments(self, inp: SendChunk) -> None:
        # The chunk's own arguments are refused in every state that takes the call (a draining
        # or failed room ignores the call, not a caller bug), like InitTransfer's.
        if inp.state_indices and not inp.is_last:
            raise InvalidInput(
                f"room {self.key}: model state travels with the last chunk only; pass "
                "state_indices with is_last=True"
            )
        refusal = wire_int_refusal("source page", inp.src_pages) or wire_int_refusal(
            "state index", chain.from_iterable(inp.state_indices)
        )
        if refusal is not None:
            raise InvalidInput(f"room {self.key}: {refusal}")

    def _validate_chunk(self, inp: SendChunk) -> None:
        # A chunk before InitTransfer or after the last one is refused by the table (guard
        # chunk_expected); only the chunk's bounds in the room are checked here.
        assert self.num_pages is not None
        end = self.next_page + len(inp.src_pages)
        if end > self.num_pages:
            raise InvalidInput(
                f"room {self.key}: chunk ends at page {end}, past num_pages={self.num_pages}"
            )
        if inp.is_last != (end == self.num_pages):
            raise InvalidInput(
                f"room {self.key}: is_last={inp.is_last} but the chunk ends at page {end} of "
                f"{self.num_pages}; exactly the chunk reaching num_pages is last"
            )
        if inp.is_last:
            self._validate_state(inp.state_indices)

    def _validate_state(self, sent: tuple[tuple[int, ...], ...]) -> None:
        """The prefill's state indices must pair one to one with every writing peer's."""
        for md in self._writable_peers().values():
            wanted = md.state_indices
            counts = [len(c) for c in sent]
            if counts != [len(c) for c in wanted]:
                raise InvalidInput(
                    f"room {self.key}: the last chunk sends state indices of sizes {counts} but "
                    f"decode {md.decode.address} published {[len(c) for c in wanted]} (one "
                    "entry per state component, as many indices as the decode expects; a "
                    "decode that publishes state needs the state sent)"
                )

    def _why_refused(self, inp: Input, now: float) -> str:
        if isinstance(inp, MetadataArrived):
            return self._disagreement(inp.metadata) or self._extra_peer(inp.metadata)
        if isinstance(inp, TransferCompleted) and inp.seq not in self.outstanding:
            return f"room {self.key}: no outstanding transfer with seq {inp.seq}"
        return super()._why_refused(inp, now)

    def _disagreement(self, md: RoomMetadata) -> str:
        """How this peer's metadata contradicts the peers' so far; empty when it agrees."""
        if self.required_dst is not None and md.required_dst_info_num != self.required_dst:
            return (
                f"room {self.key}: decode peers disagree on required_dst_info_num "
                f"({self.required_dst} vs {md.required_dst_info_num})"
            )
        if md.is_dummy:
            return ""
        for first in self.peers.values():  # the first writing peer (a loop: no list per call)
            if not first.is_dummy:
                if md.decode_prefix_len != first.decode_prefix_len:
                    return (
                        f"room {self.key}: decode peers disagree on decode_prefix_len "
                        f"({first.decode_prefix_len} vs {md.decode_prefix_len})"
                    )
                break
        return ""

    def _extra_peer(self, md: RoomMetadata) -> str:
        """Why this peer is one too many for the room; empty when it is known or there is room."""
        full = self.required_dst is not None and len(self.peers) >= self.required_dst
        if md.decode in self.peers or not full:
            return ""
        return (
            f"room {self.key}: metadata from an extra decode peer {md.decode.address} "
            f"beyond required_dst_info_num={self.required_dst}"
        )

    # ---- guards ------------------------------------------------------------------------------
    def _guard_peer_agrees(self, inp: MetadataArrived, now: float) -> bool:
        return not self._disagreement(inp.metadata)

    def _guard_peer_fits(self, inp: MetadataArrived, now: float) -> bool:
        return not self._disagreement(inp.metadata) and not self._extra_peer(inp.metadata)

    def _guard_completes_metadata(self, inp: MetadataArrived, now: float) -> bool:
        md = inp.metadata
        distinct = len(self.peers) + (0 if md.decode in self.peers else 1)
        return self._guard_peer_fits(inp, now) and distinct >= md.required_dst_info_num

    def _guard_bootstrap_expired(self, inp: Input, now: float) -> bool:
        return self.bootstrap_deadline is not None and now >= self.bootstrap_deadline

    def _guard_first_init(self, inp: InitTransfer, now: float) -> bool:
        return self.num_pages is None

    def _guard_chunk_expected(self, inp: SendChunk, now: float) -> bool:
        return self._chunk_expected()

    def _guard_finishes_without_writes(self, inp: SendChunk, now: float) -> bool:
        done = inp.is_last and not self.outstanding and not self._writable_peers()
        return self._chunk_expected() and done

    def _guard_write_outstanding(self, inp: TransferCompleted, now: float) -> bool:
        return inp.seq in self.outstanding

    def _guard_write_failed_others_pending(self, inp: TransferCompleted, now: float) -> bool:
        return inp.seq in self.outstanding and not inp.ok and len(self.outstanding) > 1

    def _guard_write_failed(self, inp: TransferCompleted, now: float) -> bool:
        return inp.seq in self.outstanding and not inp.ok

    def _guard_all_written(self, inp: TransferCompleted, now: float) -> bool:
        return inp.seq in self.outstanding and self.last_submitted and len(self.outstanding) == 1

    def _guard_writes_outstanding(self, inp: Input, now: float) -> bool:
        return bool(self.outstanding)

    def _guard_drains_last_write(self, inp: TransferCompleted, now: float) -> bool:
        return set(self.outstanding) == {inp.seq}

    # ---- actions -----------------------------------------------------------------------------
    def _act_add_peer(self, inp: MetadataArrived, now: float) -> list[Output]:
        md = inp.metadata
        self.required_dst = md.required_dst_info_num
        self.peers.setdefault(md.decode, md)
        return []

    def _act_ignore_duplicate_peer(self, inp: Input, now: float) -> list[Output]:
        return []

    def _act_arm_bootstrap_clock(self, inp: Input, now: float) -> list[Output]:
        if self.bootstrap_deadline is None:
            self.bootstrap_deadline = now + self.timeouts.bootstrap_timeout
        return []

    def _act_init(self, inp: InitTransfer, now: float) -> list[Output]:
        init = inp
        self.num_pages = init.num_pages
        self.aux_index = init.aux_index
        return []

    def _act_send_chunk(self, inp: SendChunk, now: float) -> list[Output]:
        chunk = inp
        start = self.next_page
        self.next_page += len(chunk.src_pages)
        self.last_submitted = chunk.is_last
        outputs: list[Output] = []
        for peer, md in self._writable_peers().items():
            if not chunk.src_pages and not chunk.is_last:
                continue
            seq = self.next_seq
            self.next_seq += 1
            self.outstanding[seq] = peer
            outputs.append(
                StartTransfer(
                    room=self.key,
                    generation=self.generation,
                    seq=seq,
                    peer=peer,
                    session_id=md.session_id,
                    src_pages=chunk.src_pages,
                    dst_pages=md.dst_pages[start : self.next_page],
                    is_last=chunk.is_last,
                    aux_index=md.aux_index if chunk.is_last else None,
                    staging_offset=md.staging_offset,
                    page_start=start,
                    room_pages=len(md.dst_pages),
                    src_state=chunk.state_indices,
                    dst_state=md.state_indices if chunk.is_last else (),
                    src_aux_index=(
                        self.aux_index if chunk.is_last and md.aux_index is not None else None
                    ),
                )
            )
        return outputs

    def _act_complete_write(self, inp: TransferCompleted, now: float) -> list[Output]:
        done = inp
        peer = self.outstanding.pop(done.seq)
        self._fold_checksum(peer, done.checksum)
        if done.aux is not None:
            self.aux_rows[peer] = done.aux
        return []

    def _act_succeed(self, inp: TransferCompleted, now: float) -> list[Output]:
        self._act_complete_write(inp, now)
        outputs: list[Output] = [
            SendMessage(
                to=peer,
                message=StatusReport(
                    room=self.key,
                    generation=self.generation,
                    status=_POLL_SUCCESS,
                    prefill=self.me,
                    decode=peer,
                    checksum=self.checksums.get(peer),
                    aux=self.aux_rows.get(peer),
                ),
            )
            for peer in self._writable_peers()
        ]
        return outputs

    def _act_fail_on_write_error(self, inp: TransferCompleted, now: float) -> list[Output]:
        done = inp
        self.outstanding.pop(done.seq)
        return self._fail(f"transfer failed: {done.reason or 'unknown transport error'}")

    def _act_fail_quiescent(self, inp: Input, now: float) -> list[Output]:
        reason = inp.reason if isinstance(inp, AbortRequested) else "aborted"
        return self._fail(reason)

    def _act_fail_quiescent_on_abort(self, inp: AbortArrived, now: float) -> list[Output]:
        abort = inp.abort
        self.acks_owed.add(abort.decode)
        outputs = self._fail(f"aborted by decode {abort.decode.address}: {abort.reason}")
        return outputs + self._ack_everyone()

    def _act_start_drain_on_abort(self, inp: AbortArrived, now: float) -> list[Output]:
        abort = inp.abort
        self.acks_owed.add(abort.decode)
        return self._fail(f"aborted by decode {abort.decode.address}: {abort.reason}")

    def _act_fail_bootstrap_timeout(self, inp: Input, now: float) -> list[Output]:
        return self._fail(
            f"timed out after {self.timeouts.bootstrap_timeout:g}s waiting for decode metadata "
            f"({len(self.peers)} of {self.required_dst or '?'} peers) in KVPoll.Bootstrapping"
        )

    def _act_owe_ack(self, inp: AbortArrived, now: float) -> list[Output]:
        self.acks_owed.add(inp.abort.decode)
        return []

    def _act_finish_drain(self, inp: TransferCompleted, now: float) -> list[Output]:
        self._act_complete_write(inp, now)
        return self._ack_everyone()

    def _act_ack_requester(self, inp: AbortArrived, now: float) -> list[Output]:
        return [self._ack(inp.abort.decode)]

    def _act_refuse_peer(self, inp: MetadataArrived, now: float) -> list[Output]:
        md = inp.metadata
        return [self._status_to(md.decode, KVPoll.Failed)]

    # ---- helpers -----------------------------------------------------------------------------
    def _writable_peers(self) -> dict[PeerId, RoomMetadata]:
        """The peers that are written to (dummies are not). Only read it: without dummies (the
        usual room) it is ``self.peers`` itself, not a copy built per call."""
        peers = self.peers
        for md in peers.values():
            if md.is_dummy:
                return {peer: md for peer, md in peers.items() if not md.is_dummy}
        return peers

    def _fold_checksum(self, peer: PeerId, checksum: int | None) -> None:
        current = self.checksums.get(peer, 0)
        if current is None or checksum is None:
            self.checksums[peer] = None
        else:
            self.checksums[peer] = (current + checksum) % ROOM_FOLD_MODULUS

    def _fail(self, reason: str) -> list[Output]:
        self.reason = reason
        return [self._status_to(peer, KVPoll.Failed) for peer in self._writable_peers()]

    def _ack_everyone(self) -> list[Output]:
        everyone = dict.fromkeys([*self.peers, *sorted(self.acks_owed, key=peer_order)])
        self.acks_owed.clear()
        return [self._ack(peer) for peer in everyone]

    def _ack(self, peer: PeerId) -> SendMessage:
        return SendMessage(
            to=peer,
            message=AbortAck(
                room=self.key, generation=self.generation, prefill=self.me, decode=peer
            ),
        )

    def _status_to(self, peer: PeerId, status: KVPoll) -> SendMessage:
        return SendMessage(
            to=peer,
            message=StatusReport(
                room=self.key,
                generation=self.generation,
                status=status,
                prefill=self.me,
                decode=peer,
                reason=self.reason,
            ),
        )


_M = SenderRoom
SENDER_TABLE: Table[SenderState] = Table(
    machine="SenderRoom",
    states=SenderState,
    initial=SenderState.BOOTSTRAPPING,
    inputs=(
        MetadataArrived,
        InitTransfer,
        SendChunk,
        TransferCompleted,
        AbortArrived,
        AbortRequested,
        PrefillCompleted,
        Tick,
    ),
    remote_inputs=(MetadataArrived, AbortArrived),
    poll_of=SENDER_POLL.__getitem__,
    hints={
        "InitTransfer": "call InitTransfer once per room, when it polls WaitingForInput",
        "SendChunk": "call InitTransfer first, then send chunks in order until the one marked "
        "last",
        "TransferCompleted": "report each StartTransfer exactly once",
    },
    rows=[
        # -- BOOTSTRAPPING: collecting destination metadata --------------------------------------
        row(_S.BOOTSTRAPPING, MetadataArrived, _S.WAITING_FOR_INPUT,
            guard=_M._guard_completes_metadata, emits=[_CHANGED], action=_M._act_add_peer),
        row(_S.BOOTSTRAPPING, MetadataArrived, _S.BOOTSTRAPPING,
            guard=_M._guard_peer_fits, action=_M._act_add_peer),
        row(_S.BOOTSTRAPPING, AbortArrived, _S.FAILED,
            emits=[_ACK, _STATUS, _CHANGED], action=_M._act_fail_quiescent_on_abort),
        row(_S.BOOTSTRAPPING, AbortRequested, _S.FAILED,
            emits=[_STATUS, _CHANGED], action=_M._act_fail_quiescent),
        row(_S.BOOTSTRAPPING, PrefillCompleted, _S.BOOTSTRAPPING,
            action=_M._act_arm_bootstrap_clock),
        row(_S.BOOTSTRAPPING, Tick, _S.FAILED,
            guard=_M._guard_bootstrap_expired, emits=[_STATUS, _CHANGED],
            action=_M._act_fail_bootstrap_timeout),
        # -- WAITING_FOR_INPUT: every destination known, waiting for the engine -------------------
        row(_S.WAITING_FOR_INPUT, MetadataArrived, _S.WAITING_FOR_INPUT,
            guard=_M._guard_peer_fits, action=_M._act_add_peer),
        row(_S.WAITING_FOR_INPUT, InitTransfer, _S.WAITING_FOR_INPUT,
            guard=_M._guard_first_init, action=_M._act_init),
        row(_S.WAITING_FOR_INPUT, SendChunk, _S.SUCCESS,
            guard=_M._guard_finishes_without_writes, emits=[_CHANGED], action=_M._act_send_chunk),
        row(_S.WAITING_FOR_INPUT, SendChunk, _S.TRANSFERRING,
            guard=_M._guard_chunk_expected, emits=[_START, _CHANGED], action=_M._act_send_chunk),
        row(_S.WAITING_FOR_INPUT, AbortArrived, _S.FAILED,
            emits=[_ACK, _STATUS, _CHANGED], action=_M._act_fail_quiescent_on_abort),
        row(_S.WAITING_FOR_INPUT, AbortRequested, _S.FAILED,
            emits=[_STATUS, _CHANGED], action=_M._act_fail_quiescent),
        row(_S.WAITING_FOR_INPUT, PrefillCompleted, _S.WAITING_FOR_INPUT),
        # -- TRANSFERRING: chunks in flight ------------------------------------------------------
        row(_S.TRANSFERRING, MetadataArrived, _S.TRANSFERRING,
            guard=_M._guard_peer_fits, action=_M._act_add_peer),
        row(_S.TRANSFERRING, SendChunk, _S.SUCCESS,
            guard=_M._guard_finishes_without_writes, emits=[_CHANGED], action=_M._act_send_chunk),
        row(_S.TRANSFERRING, SendChunk, _S.TRANSFERRING,
            guard=_M._guard_chunk_expected, emits=[_START], action=_M._act_send_chunk),
        row(_S.TRANSFERRING, TransferCompleted, _S.DRAINING,
            guard=_M._guard_write_failed_others_pending, emits=[_STATUS, _CHANGED],
            action=_M._act_fail_on_write_error),
        row(_S.TRANSFERRING, TransferCompleted, _S.FAILED,
            guard=_M._guard_write_failed, emits=[_STATUS, _CHANGED],
            action=_M._act_fail_on_write_error),
        row(_S.TRANSFERRING, TransferCompleted, _S.SUCCESS,
            guard=_M._guard_all_written, emits=[_STATUS, _CHANGED], action=_M._act_succeed),
        row(_S.TRANSFERRING, TransferCompleted, _S.TRANSFERRING,
            guard=_M._guard_write_outstanding, action=_M._act_complete_write),
        row(_S.TRANSFERRING, AbortArrived, _S.DRAINING,
            guard=_M._guard_writes_outstanding, emits=[_STATUS, _CHANGED],
            action=_M._act_start_drain_on_abort),
        row(_S.TRANSFERRING, AbortArrived, _S.FAILED,
            emits=[_ACK, _STATUS, _CHANGED], action=_M._act_fail_quiescent_on_abort),
        row(_S.TRANSFERRING, AbortRequested, _S.DRAINING,
            guard=_M._guard_writes_outstanding, emits=[_STATUS, _CHANGED],
            action=_M._act_fail_quiescent),
        row(_S.TRANSFERRING, AbortRequested, _S.FAILED,
            emits=[_STATUS, _CHANGED], action=_M._act_fail_quiescent),
        row(_S.TRANSFERRING, PrefillCompleted, _S.TRANSFERRING),
        # -- SUCCESS: terminal and quiescent -----------------------------------------------------
        row(_S.SUCCESS, MetadataArrived, _S.SUCCESS,
            guard=_M._guard_peer_fits, action=_M._act_ignore_duplicate_peer),
        row(_S.SUCCESS, AbortArrived, _S.SUCCESS, emits=[_ACK], action=_M._act_ack_requester),
        row(_S.SUCCESS, AbortRequested, _S.SUCCESS),
        row(_S.SUCCESS, PrefillCompleted, _S.SUCCESS),
        # -- DRAINING: failed, writes still landing; no new write, ACK only once drained ---------
        row(_S.DRAINING, MetadataArrived, _S.DRAINING,
            guard=_M._guard_peer_agrees, emits=[_STATUS], action=_M._act_refuse_peer),
        row(_S.DRAINING, SendChunk, _S.DRAINING),
        row(_S.DRAINING, TransferCompleted, _S.FAILED,
            guard=_M._guard_drains_last_write, emits=[_ACK], action=_M._act_finish_drain),
        row(_S.DRAINING, TransferCompleted, _S.DRAINING,
            guard=_M._guard_write_outstanding, action=_M._act_complete_write),
        row(_S.DRAINING, AbortArrived, _S.DRAINING, action=_M._act_owe_ack),
        row(_S.DRAINING, AbortRequested, _S.DRAINING),
        row(_S.DRAINING, PrefillCompleted, _S.DRAINING),
        # -- FAILED: terminal and quiescent; every abort is ACKed at once ------------------------
        row(_S.FAILED, MetadataArrived, _S.FAILED,
            guard=_M._guard_peer_agrees, emits=[_STATUS], action=_M._act_refuse_peer),
        row(_S.FAILED, InitTransfer, _S.FAILED),
        row(_S.FAILED, SendChunk, _S.FAILED),
        row(_S.FAILED, AbortArrived, _S.FAILED, emits=[_ACK], action=_M._act_ack_requester),
        row(_S.FAILED, AbortRequested, _S.FAILED),
        row(_S.FAILED, PrefillCompleted, _S.FAILED),
    ],
)  # fmt: skip
SenderRoom.table = SENDER_TABLE
