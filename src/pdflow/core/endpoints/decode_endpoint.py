"""DecodeEndpoint: one decode rank hosting many ReceiverRooms and the page ledger.

It resolves each room's prefill ranks from the registry's topology (cached per incarnation),
routes status reports to rooms and drain ACKs to the ledger, counts heartbeat failures per
prefill instance (its own health address, else the registry), and on a dead instance fails its
rooms, marks its writers dead and asks the shell to fence them: the ledger frees a dead writer's
pages only after that. The verdict is revisable: a lost instance that answers again as the same
incarnation and owes no drain ACK is readmitted (:mod:`pdflow.core.endpoints.liveness`); one
another incarnation replaced never is.

Where the transport has no per-peer fence, the shell fences by rotating the engine: it hands
the endpoint a new session (SessionRotated; new rooms use it, the layout is announced again),
waits until no live room depends on the old one, destroys that engine, and only then reports
SessionRetired, which frees every fenced room published under it.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum
from itertools import chain
from typing import Any

import msgspec

from pdflow.core.cluster.topology import (
    AttentionKind,
    Parallelism,
    PdTopology,
    PrefillCoordinates,
    TopologyOptions,
    resolve_rank_mapping,
)
from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.endpoints.decode_slots import DecodeRoomSlot, StatusArrived
from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ChecksumChecked,
    ClearRoom,
    CloseSession,
    DecodeEndpointConfig,
    HeartbeatResult,
    IncarnationSuperseded,
    NeedTopology,
    OpenReceiver,
    PrefillInfo,
    ReadmitWriter,
    Received,
    RoomCall,
    SessionRotated,
    StagingPlaced,
    TimerFired,
    TopologyFailed,
    TopologyKnown,
)
from pdflow.core.endpoints.liveness import LostInstance, ProbeTarget, instances_of, replaced_in
from pdflow.core.endpoints.room_host import RoomHost
from pdflow.core.endpoints.slot_inputs import ClearSlot, OpenSlot
from pdflow.core.framework.dispatch import listed_kind, remembered_kind
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.framework.table import Fired
from pdflow.core.protocol.inputs import (
    AbortRequested,
    ChecksumResult,
    FailureArrived,
    Input,
    PeerDied,
    PeersResolved,
    PrefillTarget,
    PublishPages,
    ReadyArrived,
    ResolveFailed,
    StagingWait,
    SuccessArrived,
    Tick,
)
from pdflow.core.protocol.messages import (
    AbortAck,
    KvArgs,
    KvArgsAccepted,
    PeerId,
    StatusReport,
    wire_int_refusal,
)
from pdflow.core.protocol.outputs import ArmFence, Output, SendMessage, VerifyChecksums
from pdflow.core.resources.kv_layouts import (
    AcceptArrived,
    Contact,
    LayoutAnnouncements,
    PeerLost,
)
from pdflow.core.resources.page_ledger import (
    AckArrived,
    Fence,
    LedgerInput,
    LedgerSnapshot,
    PageLedger,
    PagesFreed,
    PagesQuarantined,
    QuarantinedRoom,
    ReleaseAfterSuccess,
    ReleaseUnpublished,
    Reserve,
    RoomPagesState,
    SessionClosed,
    SessionRetired,
    VerifyDone,
    VerifyStarted,
    WriterDead,
    WriterReadmitted,
)
from pdflow.core.resources.staging_ring import (
    Assign,
    CheckReady,
    Free,
    StagingAssigned,
    StagingOversized,
    StagingReady,
    StagingRing,
    WatermarkAdvanced,
)
from pdflow.core.rooms.receiver_room import ReceiverRoom, ReceiverState


class _StagingNeed(Enum):
    """Whether a room's pages are written through the staging ring."""

    NONE = "direct"
    REQUIRED = "required"  # several writers share each page: only staging can pack them
    IF_FREE = "if_free"  # a small room: one bulk write if a region is free now, else direct


_UNFENCED = (RoomPagesState.RESERVED, RoomPagesState.VERIFYING)
_VERIFYING = (RoomPagesState.VERIFYING, RoomPagesState.RELEASING)
# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_RELEASING = RoomPagesState.RELEASING
_RECEIVER_FAILED = ReceiverState.FAILED
_AWAITING_PAGES = ReceiverState.AWAITING_PAGES
_POLL_READY = KVPoll.WaitingForInput
_POLL_SUCCESS = KVPoll.Success
_POLL_FAILED = KVPoll.Failed
_DECODE_INPUTS: frozenset[type] = frozenset(
    {
        Received, PublishPages, OpenReceiver, ClearRoom, TopologyKnown, TopologyFailed, RoomCall,
        HeartbeatResult, SessionClosed, SessionRotated, SessionRetired, ChecksumChecked, TimerFired,
    }
)  # fmt: skip
_LEDGER_NEWS: frozenset[type] = frozenset({ArmFence, VerifyChecksums})
_LEDGER_NEWS_KIND: dict[type, type] = {}
"""Each output class a room produced, mapped to the one of ``_LEDGER_NEWS`` it is, if any."""


class ReceiverSummary(msgspec.Struct, frozen=True):
    room: int
    generation: int
    state: str
    poll: KVPoll
    bootstrap: str
    succeeded: int
    required: int
    reason: str


class DecodeSnapshot(msgspec.Struct, frozen=True):
    me: str
    rooms: tuple[ReceiverSummary, ...]
    ledger: LedgerSnapshot
    heartbeat_failures: dict[str, int]
    counters: dict[str, int]
    announced_to: int = 0
    lost_instances: tuple[str, ...] = ()
    superseded: tuple[str, ...] = ()


class DecodeEndpoint(RoomHost[ReceiverRoom]):
    open_hint = (
        "open it first (DecodeRank.open, the core's OpenReceiver); a cleared room id needs a "
        "new open"
    )
    role = "decode"

    def __init__(self, config: DecodeEndpointConfig) -> None:
        self.config = config
        super().__init__(config.me)
        self.room_bootstrap: dict[int, str] = {}
        self.room_dp_rank: dict[int, int | None] = {}
        self.topologies: dict[str, PrefillInfo] = {}
        # Each known topology's resolved peers by prefill DP rank: a room's targets depend only
        # on the topology and the DP group, so they are worked out once, not once per room.
        self._resolved: dict[str, tuple[PrefillInfo, dict[int, PeersResolved]]] = {}
        self.awaiting_topology: dict[str, list[int]] = {}
        self.heartbeat_failures: Counter[str] = Counter()
        """Consecutive failed probes per probe key (an instance's health address, or the
        bootstrap address for the registry's /health)."""
        self.lost: dict[str, LostInstance] = {}
        self.superseded: set[str] = set()
        """Prefill incarnations another one replaced: never readmitted, never resolved to."""
        self.ledger = PageLedger(config.num_pages)
        self.staging = StagingRing(config.staging_capacity) if config.staging_capacity else None
        # A room's region is the ring allocation (room, chunk=generation): a reused room id
        # never inherits the region of its earlier life, which may still be fenced.
        self.waiting_for_staging: dict[int, PublishPages] = {}
        # (room, generation) -> staging bytes of each fenced room, held with its pages.
        self._fenced_staging: dict[tuple[int, int], int] = {}
        # The step a room slot's action adds its effects to, and the receiver being opened.
        self._step_out: list[Output] = []
        self._step_fired: list[Fired] = []
        self._opening = OpenReceiver(0, 0, "")
        # The one room slot, re-pointed per input: slots never nest (no slot rule fires
        # another slot input), and each input reads the slot's state afresh.
        self._slot_machine = DecodeRoomSlot(self, -1, -1)
        self.announcements = LayoutAnnouncements()
        # The transport session rooms opened now are published under (rotated by the shell).
        self.session_id = config.session_id or config.me.address

    # ---- the one entry point ---------------------------------------------------------------------
    def handle(self, inp: AnyEndpointInput, now: float) -> Step:
        out: list[Output] = []
        fired: list[Fired] = []
        # The input types are unrelated: the order only puts the per-room ones first. Compared
        # by type with ``is`` (framework/dispatch.py).
        kind = type(inp)
        if kind not in _DECODE_INPUTS:
            kind = listed_kind(inp, _DECODE_INPUTS)
        given: Any = inp  # typed again in each branch: ``kind is X`` does not narrow ``inp``
        if kind is Received:
            self._receive(given, now, out, fired)
        elif kind is PublishPages:
            self._publish(given, now, out, fired)
        elif kind is OpenReceiver:
            self._open(given, now, out, fired)
        elif kind is ClearRoom:
            clear: ClearRoom = given
            self._clear(clear.room, now, out, fired)
        elif kind is TopologyKnown:
            known: TopologyKnown = given
            self._topology_known(known.info, now, out, fired)
        elif kind is TopologyFailed:
            failed: TopologyFailed = given
            self._fail_waiting(failed.bootstrap, failed.reason, now, out, fired)
        elif kind is RoomCall:
            call: RoomCall = given
            if not isinstance(call.call, AbortRequested):
                raise LocalProtocolError(
                    f"a decode room takes AbortRequested calls, not {type(call.call).__name__}",
                    hint="publish pages with DecodeRank.publish_pages (the core's PublishPages)",
                )
            self._room_input(self._known_room(call.room), call.call, now, out, fired)
        elif kind is HeartbeatResult:
            self._heartbeat(given, now, out, fired)
        elif kind is SessionClosed:
            self._ledger(given, now, out, fired)
        elif kind is SessionRotated:
            self._rotate(given, now, fired)
        elif kind is SessionRetired:
            self._retire(given, now, out, fired)
        elif kind is ChecksumChecked:
            checked: ChecksumChecked = given
            self._slot(checked.room, checked.generation, checked, now, out, fired)
        elif kind is TimerFired:
            for room_id in self.deadlines.pop_due(now):
                if room_id in self.rooms:
                    self._room_input(self.rooms[room_id], Tick(), now, out, fired)
        else:
            raise LocalProtocolError(
                f"a decode endpoint does not take {type(inp).__name__}",
                hint="prefill-side inputs go to a PrefillEndpoint",
            )
        return Step(self._announced_first(out, now, fired), self.deadlines.earliest,
                    tuple(fired))  # fmt: skip

    def timer_at(self) -> float | None:
        return self.deadlines.earliest

    # ---- rooms -----------------------------------------------------------------------------------
    def _open(self, inp: OpenReceiver, now: float, out: list[Output], fired: list[Fired]) -> None:
        self._refuse_out_of_wire_range(inp.room, inp.generation)
        self._refuse_duplicate(inp.room)
        self._opening = inp
        self._slot(inp.room, inp.generation, OpenSlot(inp.room, inp.generation), now, out, fired)

    def _slot(
        self, room: int, generation: int, inp: Input, now: float, out: list[Output],
        fired: list[Fired],
    ) -> None:  # fmt: skip
        """Fire one input into the (room, generation) slot; it routes it on."""
        self._step_out, self._step_fired = out, fired
        produced, transition = self._slot_machine.at(room, generation).fire(inp, now)
        out.extend(produced)
        fired.append(transition)

    # ---- what the room slots ask of their endpoint (DecodeSlotHost) ----------------------------
    def host_receiver(self, room_id: int, generation: int, now: float) -> None:
        inp, out, fired = self._opening, self._step_out, self._step_fired
        cfg = self.config
        room = ReceiverRoom(
            room_id, generation, self.me, now,
            policy=cfg.policy, timeouts=cfg.timeouts,
            session_id=self.session_id,
            # A staged room is also finished by the shell (scatter, then any checksums) before
            # Success: the room knows it is staged once the endpoint placed its region.
            require_checksums=cfg.verify_checksums,
            aux_row_bytes=cfg.aux_row_bytes,
        )  # fmt: skip
        self.rooms[room_id] = room
        self.room_bootstrap[room_id] = inp.bootstrap
        self.room_dp_rank[room_id] = inp.prefill_dp_rank
        self._arm(room)
        info = self.topologies.get(inp.bootstrap)
        if info is not None:
            self._resolve(room, info, now, out, fired)
            return
        waiting = self.awaiting_topology.setdefault(inp.bootstrap, [])
        if not waiting:
            out.append(NeedTopology(inp.bootstrap))
        waiting.append(room_id)

    def deliver_status(self, room: ReceiverRoom, message: StatusReport, now: float) -> None:
        translated: Input
        status = message.status
        if status is _POLL_READY:
            translated = ReadyArrived(message.prefill)
        elif status is _POLL_SUCCESS:
            translated = SuccessArrived(message.prefill, message.checksum, message.aux)
        elif status is _POLL_FAILED:
            translated = FailureArrived(message.prefill, message.reason)
        else:
            self._drop(
                self._step_out, "bad_status", f"status {message.status.name} is not reportable"
            )
            return
        try:
            self._room_input(room, translated, now, self._step_out, self._step_fired)
        except RemoteProtocolError as exc:
            self._drop(self._step_out, "protocol_error", str(exc))

    def deliver_checksum(self, room: ReceiverRoom, result: ChecksumChecked, now: float) -> None:
        out, fired = self._step_out, self._step_fired
        self.verification_ended(room.key, room.generation, now)
        self._room_input(room, ChecksumResult(result.ok, result.reason), now, out, fired)
        # Every writer reported Success before verification: the region is done with.
        if self.staging is not None:
            self._release_staging(room.key, room.generation, now, out, fired)

    def forget_receiver(self, room: ReceiverRoom, now: float) -> None:
        out, fired = self._step_out, self._step_fired
        if self.ledger.state_of(room.key, room.generation) in _UNFENCED:
            # Reserved but never fenced: every writer reported Success (a success, or a failed
            # checksum), so no write can still land; a verification still running holds them.
            self._ledger(ReleaseAfterSuccess(room.key, room.generation), now, out, fired)
        self.room_bootstrap.pop(room.key, None)
        self.room_dp_rank.pop(room.key, None)
        self.deadlines.arm(room.key, None)

    def count(self, counter: str) -> None:
        self.counters[counter] += 1

    def releasing_after_verify(self, room: int, generation: int) -> bool:
        return self.ledger.state_of(room, generation) is _RELEASING

    def verification_ended(self, room: int, generation: int, now: float) -> None:
        if self.ledger.state_of(room, generation) in _VERIFYING:
            self._ledger(VerifyDone(room, generation), now, self._step_out, self._step_fired)

    def _topology_known(
        self, info: PrefillInfo, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        cached = self.topologies.get(info.bootstrap)
        if cached is not None and cached != info:
            # A late answer (fetches race): the cached instance is the one the heartbeat and
            # the fences track; a restart is reported by the heartbeat, never by overwriting.
            self._drop(out, "stale_topology", f"topology of {info.bootstrap} is already known")
            return
        problem = self._incompatibility(info) or self._stale(info, out)
        if problem:
            self._fail_waiting(info.bootstrap, problem, now, out, fired)
            return
        dead = next((r.peer for r in info.ranks if self.ledger.is_dead(r.peer)), None)
        if dead is not None:
            # Never resolve a room to a writer declared dead and not readmitted (its writes
            # are fenced): fail the waiting rooms now; the engine retries later.
            reason = (
                f"prefill incarnation {dead.incarnation} at {info.bootstrap} was declared dead "
                "and is not readmitted yet (it has not answered a probe since, or still owes "
                "drain ACKs); retry the request"
            )
            self._fail_waiting(info.bootstrap, reason, now, out, fired)
            return
        self.topologies[info.bootstrap] = info
        for target in instances_of(info):
            self.heartbeat_failures.pop(target.key, None)
        for room_id in self.awaiting_topology.pop(info.bootstrap, []):
            room = self.rooms.get(room_id)
            if room is not None and room.state is ReceiverState.BOOTSTRAPPING:
                self._resolve(room, info, now, out, fired)

    def _incompatibility(self, info: PrefillInfo) -> str:
        cfg = self.config
        if info.page_size != cfg.page_size:
            return f"page size mismatch: prefill {info.page_size}, decode {cfg.page_size}"
        if info.kv_cache_dtype != cfg.kv_cache_dtype:
            return f"KV dtype mismatch: prefill {info.kv_cache_dtype}, decode {cfg.kv_cache_dtype}"
        if info.policy is not cfg.policy:
            return (
                f"allocation policy mismatch: prefill {info.policy.value}, "
                f"decode {cfg.policy.value}; configure both sides alike"
            )
        if info.is_mla != cfg.is_mla:
            kinds = {True: "MLA", False: "MHA/GQA"}
            return (
                f"attention kind mismatch: the prefill at {info.bootstrap} registered "
                f"{kinds[info.is_mla]} KV, this decode holds {kinds[cfg.is_mla]}; the two "
                "instances must serve the same model"
            )
        if cfg.verify_checksums and info.checksum is False:
            return (
                f"checksum mismatch: this decode requires KV checksums but the prefill at "
                f"{info.bootstrap} registered without them; set PDFLOW_CHECKSUM=1 on the "
                "prefill too, or turn it off on the decode"
            )
        return ""

    def _stale(self, info: PrefillInfo, out: list[Output]) -> str:
        """Why rooms must never resolve to this topology: it names an incarnation another
        one replaced. A lost instance it shows replaced is superseded here."""
        same = [lost for lost in self.lost.values() if lost.target.bootstrap == info.bootstrap]
        for lost in same:
            if replaced_in(info, lost):
                self._supersede(self.lost.pop(lost.target.key), out)
        for rank in info.ranks:
            if rank.peer.incarnation in self.superseded:
                return (
                    f"the registry at {info.bootstrap} names prefill incarnation "
                    f"{rank.peer.incarnation}, which another incarnation replaced; is a stale "
                    "process still registered?"
                )
        return ""

    def _fail_waiting(
        self, bootstrap: str, reason: str, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        for room_id in self.awaiting_topology.pop(bootstrap, []):
            room = self.rooms.get(room_id)
            if room is not None and room.state is ReceiverState.BOOTSTRAPPING:
                self._room_input(room, ResolveFailed(reason), now, out, fired)

    def _resolve(
        self, room: ReceiverRoom, info: PrefillInfo, now: float, out: list[Output],
        fired: list[Fired],
    ) -> None:  # fmt: skip
        try:
            resolved = self._targets(room.key, info)
        except InvalidInput as exc:
            self._room_input(room, ResolveFailed(str(exc)), now, out, fired)
            return
        self._room_input(room, resolved, now, out, fired)

    def _targets(self, room_id: int, info: PrefillInfo) -> PeersResolved:
        if (
            info.dp_size > 1
            and not info.follow_bootstrap_room
            and (self.room_dp_rank.get(room_id) is None)
        ):
            # room % dp would pick a DP group that may not hold the room: never guess.
            raise InvalidInput(
                f"room {room_id}: the prefill at {info.bootstrap} does not route rooms to DP "
                f"groups by room % {info.dp_size} (follow_bootstrap_room is off); open the room "
                "with the prefill_dp_rank it registered (POST /query_dp_ranks)"
            )
        if room_id < 0:
            return self._resolve_targets(room_id, info)  # refused there, as it always was
        explicit = self.room_dp_rank.get(room_id)
        dp_rank = explicit if explicit is not None else room_id % info.dp_size
        entry = self._resolved.get(info.bootstrap)
        if entry is None or entry[0] is not info:
            entry = self._resolved[info.bootstrap] = (info, {})
        resolved = entry[1].get(dp_rank)
        if resolved is None:
            resolved = entry[1][dp_rank] = self._resolve_targets(room_id, info)
        return resolved

    def _resolve_targets(self, room_id: int, info: PrefillInfo) -> PeersResolved:
        cfg = self.config
        topology = PdTopology(
            prefill=Parallelism(tp=info.tp_size, cp=info.cp_size, pp=info.pp_size, dp=info.dp_size),
            decode=Parallelism(tp=cfg.tp_size, pp=cfg.pp_size, dp=cfg.dp_size),
            attention=AttentionKind.MLA if cfg.is_mla else AttentionKind.MHA,
            num_kv_heads=1 if cfg.is_mla else cfg.num_kv_heads,
            options=TopologyOptions(prefill_dp_rank=self.room_dp_rank.get(room_id)),
        )
        mapping = resolve_rank_mapping(
            topology,
            decode_engine_rank=cfg.dp_rank * cfg.tp_size + cfg.tp_rank,
            room=room_id,
            decode_pp_rank=cfg.pp_rank,
        )
        by_coordinates = {
            PrefillCoordinates(dp=r.dp, cp=r.cp, tp=r.tp, pp=r.pp): r.peer for r in info.ranks
        }
        targets = []
        for target in mapping.targets:
            peer = by_coordinates.get(target.rank)
            if peer is None:
                raise InvalidInput(
                    f"prefill rank {target.rank} is not registered at {info.bootstrap}"
                )
            targets.append(PrefillTarget(peer, target.is_dummy))
        return PeersResolved(
            tuple(targets), mapping.required_prefill_response_num, mapping.required_dst_info_num
        )

    def _publish(
        self, inp: PublishPages, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        room = self._known_room(inp.room)
        refusal = (
            wire_int_refusal("destination page", inp.dst_pages)
            or wire_int_refusal("aux_index", () if inp.aux_index is None else inp.aux_index)
            or wire_int_refusal("state index", chain.from_iterable(inp.state_indices))
            or wire_int_refusal("decode_prefix_len", inp.decode_prefix_len)
        )
        if refusal is not None:
            # Checked before the ledger or the staging ring sees the call: the room's metadata
            # carries every one of them, and no peer decodes one outside the range.
            raise InvalidInput(f"room {inp.room}: {refusal}")
        page_size = self.config.page_size
        if inp.decode_prefix_len % page_size:
            raise InvalidInput(
                f"room {inp.room}: decode_prefix_len {inp.decode_prefix_len} is not a "
                f"non-negative multiple of page_size {page_size}; a cached prefix ends on a page "
                "boundary (publish pages for the tokens after it)"
            )
        if room.state is _RECEIVER_FAILED:
            # Failed before its pages were exposed: no writer knows them, hand them back now.
            # They are checked as a Reserve checks them: freeing pages the engine never took
            # from the ledger (another room's, or none at all) would report them free twice.
            self.ledger.check_free(inp.dst_pages)
            self._room_input(room, inp, now, out, fired)
            out.append(PagesFreed(room.key, room.generation, inp.dst_pages))
            return
        if room.state is not _AWAITING_PAGES or inp.room in self.waiting_for_staging:
            raise LocalProtocolError(
                f"room {inp.room} is {room.state.name}; pages are published once, "
                "in AWAITING_PAGES (KVPoll.WaitingForInput)",
                hint="poll the room and publish when it reports WaitingForInput",
            )
        # The ledger refuses pages that are not free (e.g. still quarantined) before any change.
        self._ledger(Reserve(room.key, room.generation, inp.dst_pages), now, out, fired)
        staging = self._staging_need(room, inp)
        if staging is _StagingNeed.NONE:
            self._room_input(room, inp, now, out, fired)
            return
        if staging is _StagingNeed.IF_FREE:
            self._stage_if_free(room, inp, now, out, fired)
            return
        self.waiting_for_staging[room.key] = inp
        self._place_staging(room, inp, now, out, fired)
        if room.key in self.waiting_for_staging:
            # Deferred: the room holds its pages and a ring region; its waiting budget runs.
            self._room_input(room, StagingWait(), now, out, fired)

    def _staging_need(self, room: ReceiverRoom, inp: PublishPages) -> _StagingNeed:
        """Staging is required when several prefill TP ranks write slices of one page, and
        taken if free for a small room of one writer (``stage_rooms_up_to``): one bulk write
        costs the engine far less than one write per buffer. A small room is staged only for
        a prefill that registered a staging slot holding it: a writer without one could not
        gather the room, and one that wrote the pages directly would see them overwritten
        by the ring's scatter. A prefill with pipeline stages writes its layers directly (its
        writer regions would depend on each stage's layers)."""
        if self.staging is None:
            return _StagingNeed.NONE
        info = self.topologies.get(self.room_bootstrap.get(room.key, ""))
        if info is not None and info.pp_size != 1:
            return _StagingNeed.NONE
        writers = len(room.writers)
        if writers > 1:
            return _StagingNeed.REQUIRED
        nbytes = len(inp.dst_pages) * self.config.staging_page_bytes
        if (
            writers == 1
            and info is not None
            and 0 < nbytes <= min(self.config.stage_rooms_up_to, info.staging_slot_bytes)
        ):
            return _StagingNeed.IF_FREE
        return _StagingNeed.NONE

    def _stage_if_free(
        self, room: ReceiverRoom, inp: PublishPages, now: float, out: list[Output],
        fired: list[Fired],
    ) -> None:  # fmt: skip
        """A small room takes a ring region only if it is free now, else it is written directly:
        it never waits, so a region pinned by a dead writer slows small rooms, never stalls
        them."""
        nbytes = len(inp.dst_pages) * self.config.staging_page_bytes
        placed = self._ring(Assign(room.key, room.generation, nbytes), now, out, fired)
        assigned = next((o for o in placed if isinstance(o, StagingAssigned)), None)
        if assigned is not None and not self._placed_if_ready(
            room, assigned.offset, nbytes, now, out, fired
        ):
            self._ring(Free(room.key, room.generation), now, out, fired)
        self._room_input(room, inp, now, out, fired)

    def _placed_if_ready(
        self, room: ReceiverRoom, offset: int, nbytes: int, now: float, out: list[Output],
        fired: list[Fired],
    ) -> bool:  # fmt: skip
        """Whether the room's assigned region is free to write now; if so it is the room's."""
        ready = self._ring(CheckReady(room.key, room.generation), now, out, fired)
        if not any(isinstance(o, StagingReady) for o in ready):
            return False
        out.append(StagingPlaced(room.key, room.generation, offset, nbytes))
        room.staging_offset = offset
        return True

    def _place_staging(
        self, room: ReceiverRoom, inp: PublishPages, now: float, out: list[Output],
        fired: list[Fired],
    ) -> None:  # fmt: skip
        nbytes = len(inp.dst_pages) * self.config.staging_page_bytes
        placed = self._ring(Assign(room.key, room.generation, max(nbytes, 1)), now, out, fired)
        oversized = [o for o in placed if isinstance(o, StagingOversized)]
        if oversized:
            del self.waiting_for_staging[room.key]
            self._room_input(room, AbortRequested(oversized[0].reason), now, out, fired)
            self._release_unpublished(room, now, out, fired)
            return
        assigned = next(o for o in placed if isinstance(o, StagingAssigned))
        if self._placed_if_ready(room, assigned.offset, nbytes, now, out, fired):
            del self.waiting_for_staging[room.key]
            self._room_input(room, inp, now, out, fired)

    def _retry_staging(self, now: float, out: list[Output], fired: list[Fired]) -> None:
        """Place the waiting rooms the advanced watermark frees, in room id order.

        Only the freed ones are visited: a room waits from its publish on, and its region was
        assigned then at the ring's head, so ``waiting_for_staging`` (insertion ordered) is in
        ring position order, and a region is free only if every region before it is
        (``watermark_allows`` is monotone in position). The walk stops at the first room still
        blocked; retrying every waiting room made each advance O(waiting)."""
        ring = self.staging
        assert ring is not None  # only a ring's watermark advance retries
        freed: list[int] = []
        for room_id in self.waiting_for_staging:
            held = ring.live[(room_id, self.rooms[room_id].generation)]
            if not ring.is_ready(held.offset, held.round, held.end):
                break
            freed.append(room_id)
        for room_id in sorted(freed):
            room = self.rooms[room_id]
            if room.state is ReceiverState.AWAITING_PAGES:
                self._place_staging(room, self.waiting_for_staging[room_id], now, out, fired)

    def _release_staging(
        self, room: int, generation: int, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        if self.staging is not None and (room, generation) in self.staging.live:
            self._ring(Free(room, generation), now, out, fired)

    def _release_unpublished(
        self, room: ReceiverRoom, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        """Pages reserved for a room that never published them: nobody can write there."""
        if self.ledger.state_of(room.key, room.generation) is RoomPagesState.RESERVED:
            self._ledger(ReleaseUnpublished(room.key, room.generation), now, out, fired)
        self._release_staging(room.key, room.generation, now, out, fired)

    def _ring(self, inp: Input, now: float, out: list[Output], fired: list[Fired]) -> list[Output]:
        if self.staging is None:
            raise LocalProtocolError("this decode endpoint has no staging ring (capacity 0)")
        produced, transition = self.staging.fire(inp, now)
        out.extend(produced)
        fired.append(transition)
        if any(isinstance(o, WatermarkAdvanced) for o in produced) and self.waiting_for_staging:
            self._retry_staging(now, out, fired)
        return produced

    def _clear(self, room_id: int, now: float, out: list[Output], fired: list[Fired]) -> None:
        room = self._known_room(room_id)
        self._slot(room_id, room.generation, ClearSlot(room_id, room.generation), now, out, fired)

    # ---- messages --------------------------------------------------------------------------------
    def _receive(self, inp: Received, now: float, out: list[Output], fired: list[Fired]) -> None:
        message = inp.message
        if not isinstance(message, (StatusReport, AbortAck, KvArgsAccepted)):
            self._drop(out, "wrong_direction", f"{type(message).__name__} sent to a decode")
            return
        if message.decode != self.me:
            # Meant for an earlier life of this rank (or misrouted): nothing here can match it.
            self._drop(
                out,
                "stale_incarnation",
                f"{type(message).__name__} for "
                f"{message.decode.address}/{message.decode.incarnation}",
            )
            return
        if isinstance(message, KvArgsAccepted):
            try:
                _, transition = self.announcements.fire(
                    message.prefill, AcceptArrived(message), now
                )
            except RemoteProtocolError:
                self._drop(out, "unannounced_prefill", f"KvArgsAccepted from "
                           f"{message.prefill.address}/{message.prefill.incarnation}")  # fmt: skip
                return
            fired.append(transition)
            return
        if self._bad_generation(message, out):
            return
        if isinstance(message, AbortAck):
            ack = AckArrived(message.room, message.generation, message.prefill)
            try:
                self._ledger(ack, now, out, fired)
            except RemoteProtocolError as exc:
                # No ABORT goes out for pages being verified or released: a forged ACK.
                self._drop(out, "protocol_error", str(exc))
                return
            self._acked_by_lost(message.prefill, now, out, fired)
            return
        self._slot(message.room, message.generation, StatusArrived(message), now, out, fired)

    def _heartbeat(
        self, inp: HeartbeatResult, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        target = ProbeTarget(inp.bootstrap, inp.health)
        self._revisit_lost(target, inp, now, out, fired)
        info = self.topologies.get(inp.bootstrap)
        peers = instances_of(info).get(target, ()) if info else ()
        if not peers:
            return
        known = {p.incarnation for p in peers}
        restarted = inp.ok and inp.incarnation not in (None, *known)
        if inp.ok and not restarted:
            self.heartbeat_failures.pop(target.key, None)
            return
        if not inp.ok:
            self.heartbeat_failures[target.key] += 1
            self.counters["heartbeat_failures"] += 1
            if self.heartbeat_failures[target.key] < self.config.heartbeat_max_failure:
                return
        self._instance_lost(target, peers, now, out, fired)
        if restarted:
            self._supersede(self.lost.pop(target.key), out)

    def _instance_lost(
        self, target: ProbeTarget, peers: tuple[PeerId, ...], now: float, out: list[Output],
        fired: list[Fired],
    ) -> None:  # fmt: skip
        """The ranks this probe speaks for (as we knew them) are gone: fail their rooms, mark
        them dead and fence them. They stay probed, in case they were only paused."""
        bootstrap = target.bootstrap
        self.topologies.pop(bootstrap, None)
        self._resolved.pop(bootstrap, None)
        self.heartbeat_failures.pop(target.key, None)
        self.counters["prefill_instances_lost"] += 1
        for room_id in sorted(self.rooms):
            room = self.rooms[room_id]
            if self.room_bootstrap.get(room_id) != bootstrap or room.poll.is_terminal:
                continue
            if not room.targets:
                self._room_input(room, ResolveFailed("prefill instance lost"), now, out, fired)
                self._forget_waiting(bootstrap, room_id)
                continue
            dead = next((t.peer for t in room.targets if t.peer in peers), None)
            if dead is not None:
                self._room_input(room, PeerDied(dead), now, out, fired)
        sessions: dict[PeerId, str | None] = {}
        for peer in peers:
            self._ledger(WriterDead(peer), now, out, fired)
            session = self.announcements.session_of(peer)
            sessions[peer] = session
            out.append(CloseSession(peer, session))
            if self.announcements.is_announced(peer):
                fired.append(self.announcements.fire(peer, PeerLost(), now)[1])
        self.lost[target.key] = LostInstance(target, peers, sessions, lost_at=now)

    def _revisit_lost(
        self, target: ProbeTarget, inp: HeartbeatResult, now: float, out: list[Output],
        fired: list[Fired],
    ) -> None:  # fmt: skip
        """A probe of an instance declared dead: the same incarnation answering may be
        readmitted; another one answering there has replaced it."""
        lost = self.lost.get(target.key)
        if lost is None:
            return
        if not inp.ok or inp.incarnation is None:
            self._forget_if_given_up(lost, now, out)
            return
        if inp.incarnation in lost.incarnations:
            lost.answered = True
            self._try_readmit(lost, now, out, fired)
        else:
            self._supersede(self.lost.pop(target.key), out)

    def _forget_if_given_up(self, lost: LostInstance, now: float, out: list[Output]) -> None:
        """Still silent ``lost_instance_forget_s`` after the verdict, and no room refers to it
        (a failed room the engine has not cleared yet does): give it up, as if superseded. Its
        fenced pages are untouched: they still wait for their drain ACK or a fence."""
        if now - lost.lost_at < self.config.lost_instance_forget_s:
            return
        if lost.target.bootstrap in self.room_bootstrap.values():
            return
        self.counters["prefill_instances_forgotten"] += 1
        self._supersede(self.lost.pop(lost.target.key), out)

    def _try_readmit(
        self, lost: LostInstance, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        """Readmit once it answered and ACKed every room fenced while it may have written:
        only then can no write it issues from now on land in a page freed meanwhile."""
        if not lost.answered or any(self.ledger.owes_acks(p) for p in lost.peers):
            return
        del self.lost[lost.target.key]
        self.counters["prefill_instances_readmitted"] += 1
        for peer in lost.peers:
            self._ledger(WriterReadmitted(peer), now, out, fired)
            out.append(ReadmitWriter(peer, lost.sessions.get(peer)))
        self._refetch_for_waiting(lost.target.bootstrap, out)

    def _supersede(self, lost: LostInstance, out: list[Output]) -> None:
        for incarnation in sorted(lost.incarnations - self.superseded):
            self.superseded.add(incarnation)
            self.counters["prefill_incarnations_superseded"] += 1
            out.append(IncarnationSuperseded(lost.target.bootstrap, incarnation))
        self._refetch_for_waiting(lost.target.bootstrap, out)

    def _refetch_for_waiting(self, bootstrap: str, out: list[Output]) -> None:
        """Rooms parked on a lost instance's topology: fetch it again now that it changed."""
        if self.awaiting_topology.get(bootstrap) and bootstrap not in self.topologies:
            out.append(NeedTopology(bootstrap))

    def _acked_by_lost(
        self, writer: PeerId, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        for lost in list(self.lost.values()):
            if writer in lost.peers:
                self._try_readmit(lost, now, out, fired)

    def bootstraps_in_use(self) -> set[str]:
        """Every bootstrap address the shell may still be asked about: known topologies, rooms,
        rooms waiting for a topology (the shell keeps a client for each, and closes the rest)."""
        return {*self.topologies, *self.room_bootstrap.values(), *self.awaiting_topology}

    def probe_targets(self) -> tuple[ProbeTarget, ...]:
        """What the shell's heartbeat probes: every instance of a known topology, and every
        lost one that may yet answer again."""
        targets = {t for info in self.topologies.values() for t in instances_of(info)}
        targets |= {lost.target for lost in self.lost.values()}
        return tuple(sorted(targets))

    # ---- fence by engine rotation ----------------------------------------------------------------
    def _rotate(self, inp: SessionRotated, now: float, fired: list[Fired]) -> None:
        if not inp.session or inp.session == self.session_id:
            raise InvalidInput(
                f"SessionRotated must name a new transport session, got {inp.session!r} "
                f"(current {self.session_id!r}); open a new engine first"
            )
        self.session_id = inp.session
        for room in self.rooms.values():
            if room.published is None and not room.poll.is_terminal:
                room.session_id = inp.session  # no writer has been told its session yet
        fired.extend(self.announcements.layout_changed(now))
        self.counters["sessions_rotated"] += 1

    def _retire(
        self, inp: SessionRetired, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        if inp.session == self.session_id:
            raise InvalidInput(
                f"cannot retire transport session {inp.session!r}: it is the current one; "
                "rotate first (SessionRotated)"
            )
        live = self.live_rooms_on(inp.session)
        if live:
            raise InvalidInput(
                f"cannot retire transport session {inp.session!r}: rooms {list(live)} still "
                "depend on it; destroy its engine and retire it once they ended"
            )
        self.counters["sessions_retired"] += 1
        self._ledger(inp, now, out, fired)
        # A lost writer owes no ACK for rooms of the destroyed engine: one that answered may be
        # readmitted now rather than once its writes to that engine fail and it drains.
        for lost in list(self.lost.values()):
            self._try_readmit(lost, now, out, fired)

    def live_rooms_on(self, session: str) -> tuple[int, ...]:
        """Rooms not ended whose writers were (or will be) told to write through ``session``:
        its engine must outlive them."""
        return tuple(
            room_id for room_id, room in sorted(self.rooms.items())
            if room.session_id == session and not room.poll.is_terminal
        )  # fmt: skip

    @property
    def dead_held_pages(self) -> int:
        """Quarantined pages waiting only on writers declared dead (O(fenced rooms))."""
        return self.ledger.dead_held_pages()

    def _forget_waiting(self, bootstrap: str, room_id: int) -> None:
        waiting = self.awaiting_topology.get(bootstrap)
        if waiting and room_id in waiting:
            waiting.remove(room_id)
            if not waiting:
                del self.awaiting_topology[bootstrap]

    # ---- plumbing --------------------------------------------------------------------------------
    def _announced_first(
        self, out: list[Output], now: float, fired: list[Fired]
    ) -> tuple[Output, ...]:
        """The step's outputs, each first message to a prefill rank preceded by this rank's
        KV layout (the shell sends them in order, on one channel). Only ranks of instances
        known now are announced to: the ABORTs to a lost instance's writers are not."""
        layout = self.config.kv_layout
        if layout is None:
            return tuple(out)
        # The known ranks are gathered only for a step that sends to a rank not yet accepted
        # (every step runs this; most send nothing, or only to accepted ranks).
        known: set[PeerId] | None = None
        ordered: list[Output] = []
        for output in out:
            if isinstance(output, SendMessage) and not self.announcements.is_accepted(output.to):
                if known is None:
                    known = {r.peer for info in self.topologies.values() for r in info.ranks}
                if output.to not in known:
                    ordered.append(output)
                    continue
                produced, transition = self.announcements.fire(
                    output.to, Contact(self._kv_args(layout, output.to)), now
                )
                ordered.extend(produced)
                fired.append(transition)
            ordered.append(output)
        return tuple(ordered)

    def announcement(self, prefill: PeerId) -> KvArgs | None:
        """The KvArgs this rank announces to ``prefill`` (None: it announces no layout)."""
        layout = self.config.kv_layout
        return None if layout is None else self._kv_args(layout, prefill)

    def _kv_args(self, layout: KvBuffers, prefill: PeerId) -> KvArgs:
        cfg = self.config
        return KvArgs(
            decode=self.me, prefill=prefill, session_id=self.session_id,
            layout=layout, tp_size=cfg.tp_size, tp_rank=cfg.tp_rank,
            total_kv_heads=cfg.num_kv_heads, staging_addr=cfg.staging_addr, state=cfg.state,
            started_at=cfg.started_at,
        )  # fmt: skip

    def _room_input(
        self, room: ReceiverRoom, inp: Input, now: float, out: list[Output], fired: list[Fired]
    ) -> None:
        produced, transition = room.fire(inp, now)
        fired.append(transition)
        for output in produced:
            out.append(output)
            # Compared by type with ``is`` (framework/dispatch.py): most outputs are neither.
            kind = _LEDGER_NEWS_KIND.get(type(output))
            if kind is None:
                kind = remembered_kind(output, _LEDGER_NEWS, _LEDGER_NEWS_KIND)
            if kind is ArmFence:
                # The ledger learns of the fence in the same step, before any ABORT is sent.
                arm: ArmFence = output  # type: ignore[assignment]
                fence = Fence(arm.room, arm.generation, arm.writers, room.session_id)
                self._ledger(fence, now, out, fired)
            elif kind is VerifyChecksums:
                # The shell's verification writes the pages too (the staged scatter).
                verify: VerifyChecksums = output  # type: ignore[assignment]
                self._ledger(VerifyStarted(verify.room, verify.generation), now, out, fired)
        # RoomHost._arm, inlined (once or twice per step): only the open room has a deadline.
        # Most steps disarm a key that is not armed: that call is skipped (it does nothing).
        key = room.key
        if self.rooms.get(key) is room:
            deadline, deadlines = room.timer_at(), self.deadlines
            if deadline is not None or key in deadlines.armed:
                deadlines.arm(key, deadline)
        if room.state is _RECEIVER_FAILED and room.key in self.waiting_for_staging:
            del self.waiting_for_staging[room.key]
            self._release_unpublished(room, now, out, fired)

    def _ledger(self, inp: LedgerInput, now: float, out: list[Output], fired: list[Fired]) -> None:
        produced, transitions = self.ledger.apply(inp, now)
        out.extend(produced)
        fired.extend(transitions)
        if self.staging is not None:
            # A fenced room's staging region is released with its pages, never before.
            for output in produced:
                if isinstance(output, PagesQuarantined):
                    held = self.staging.live.get((output.room, output.generation))
                    if held is not None:
                        self._fenced_staging[(output.room, output.generation)] = held.nbytes
                elif isinstance(output, PagesFreed):
                    self._fenced_staging.pop((output.room, output.generation), None)
                    self._release_staging(output.room, output.generation, now, out, fired)

    # ---- read-only views -------------------------------------------------------------------------
    def clearable_rooms(self) -> tuple[int, ...]:
        """Terminal rooms the engine may clear now."""
        return tuple(r for r in self.open_rooms() if self.rooms[r].poll.is_terminal)

    @property
    def allocatable_pages(self) -> int:
        """Pages neither reserved nor quarantined."""
        return self.ledger.allocatable

    def free_pages(self) -> tuple[int, ...]:
        """Pages the engine may publish now, in order."""
        return tuple(p for p in range(self.ledger.pool_size) if self.ledger.is_free(p))

    def page_holder(self, page: int) -> tuple[int, int] | None:
        """The (room, generation) whose pages include ``page``; None when the page is free."""
        for held in self.ledger.snapshot().rooms:
            if page in held.pages:
                return (held.room, held.generation)
        return None

    def quarantine(self, now: float) -> tuple[QuarantinedRoom, ...]:
        """Failed rooms whose pages (and staging region) wait for writers to be cleared, and
        since when."""
        report = self.ledger.report(now)
        if self.staging is None:
            return report
        held = self._fenced_staging
        return tuple(
            msgspec.structs.replace(q, staging_bytes=held.get((q.room, q.generation), 0))
            for q in report
        )

    @property
    def quarantined_staging_bytes(self) -> int:
        """Staging-ring bytes held by fenced rooms (a dead writer's stay until its drain ACK):
        what rooms waiting for ring space wait behind. O(fenced staged rooms)."""
        return sum(self._fenced_staging.values())

    @property
    def dead_held_staging_bytes(self) -> int:
        """Staging-ring bytes of fenced rooms that wait only on writers declared dead: any of
        them pins the ring's watermark for good (every later chunk defers behind it once the
        ring wraps), so only a rotation of the session frees the ring. O(fenced rooms)."""
        held = self._fenced_staging
        return sum(held.get(key, 0) for key in self.ledger.dead_held_rooms())

    @property
    def quarantined_pages(self) -> int:
        """Pages held by failed rooms until their writers are cleared (O(1))."""
        return self.ledger.quarantined_pages

    def oldest_fenced_at(self) -> float | None:
        """When the longest-quarantined room was fenced (None: no page is quarantined)."""
        return self.ledger.oldest_fenced_at()

    def writers_of(self, room_id: int) -> tuple[PeerId, ...]:
        """The prefill ranks that write into the open room's pages; () when it is not open."""
        room = self.rooms.get(room_id)
        return () if room is None else room.writers

    def summary(self, room_id: int) -> ReceiverSummary | None:
        room = self.rooms.get(room_id)
        if room is None:
            return None
        return ReceiverSummary(
            room.key, room.generation, room.state.name, room.poll,
            self.room_bootstrap.get(room_id, ""), len(room.succeeded), room.required_responses,
            room.reason,
        )  # fmt: skip

    def snapshot(self) -> DecodeSnapshot:
        summaries = tuple(s for s in (self.summary(r) for r in sorted(self.rooms)) if s is not None)
        return DecodeSnapshot(
            self.label,
            summaries,
            self.ledger.snapshot(),
            dict(sorted(self.heartbeat_failures.items())),
            dict(sorted(self.counters.items())),
            len(self.announcements),
            tuple(sorted(self.lost)),
            tuple(sorted(self.superseded)),
        )
