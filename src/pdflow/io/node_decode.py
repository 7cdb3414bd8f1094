"""DecodeNode: the decode ranks of one process, each a core DecodeEndpoint with its page ledger.

It fetches prefill topologies from their bootstrap registries, hands each rank's core its KV
layout (the core announces it to every prefill rank before its first message), heartbeats the
prefill instances it knows, closes the transport sessions of writers the core declared dead,
and recomputes checksums when the core asks. Where the transport has no per-peer fence but can
rotate its engine, it fences by rotation (:meth:`DecodeNode.reclaim_quarantine`). Pages come
back to the engine only through :class:`~pdflow.io.node_common.PagesReleased` events; see
docs/embedding.md.
"""

from __future__ import annotations

import ctypes
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import structlog

from pdflow.core.cluster.registry import (
    declared_checksum,
    declared_is_mla,
    declared_staging_slot_bytes,
)
from pdflow.core.cluster.topology import Parallelism, prefill_unique_rank
from pdflow.core.dataplane.buffers import TpPlace, destination_slices
from pdflow.core.dataplane.checksum import ROOM_FOLD_MODULUS
from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint, DecodeSnapshot
from pdflow.core.endpoints.effects import DecodeEffects, carry_out_decode
from pdflow.core.endpoints.endpoint_io import (
    ChecksumChecked,
    ClearRoom,
    CloseSession,
    DecodeEndpointConfig,
    HeartbeatResult,
    IncarnationSuperseded,
    OpenReceiver,
    PrefillInfo,
    ReadmitWriter,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    RoomRemoved,
    SessionRotated,
    StagingPlaced,
    TopologyFailed,
    TopologyKnown,
)
from pdflow.core.endpoints.liveness import ProbeTarget
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import AbortRequested, PublishPages
from pdflow.core.protocol.messages import WIRE_INT_MAX, AnyMessage, PeerId, StatusReport
from pdflow.core.protocol.outputs import StoreAux, VerifyChecksums
from pdflow.core.resources.admission import (
    CLIP_MAX_NEW_TOKENS,
    NUM_RESERVED_DECODE_TOKENS,
    AdmissionBudget,
)
from pdflow.core.resources.kv_layouts import layout_bytes
from pdflow.core.resources.page_ledger import (
    PagesFreed,
    PagesQuarantined,
    QuarantinedRoom,
    RoomPagesState,
    SessionClosed,
    SessionRetired,
)
from pdflow.core.resources.staging_ring import SMALL_ROOM_STAGING_LIMIT
from pdflow.dataplane.executor import Executor
from pdflow.io.admission_gate import AdmissionGate
from pdflow.io.bootstrap_client import BootstrapClient, BootstrapError, HealthStatus
from pdflow.io.codec import ControlMessage, MsgpackCodec, WireCodec, wire_frames
from pdflow.io.control import ControlChannel, Deliver
from pdflow.io.heartbeat import run_heartbeat
from pdflow.io.kv_buffers import (
    EngineMemory,
    RankKv,
    StateIndices,
    WriterRegion,
    aux_buffer_of,
    check_state_indices,
    copy_staged_host,
    executor_for,
    in_host_memory,
    kv_digest,
    staged_slices,
    staging_page_bytes,
    state_digest,
    state_slices,
    write_aux_row,
    writer_region,
)
from pdflow.io.node_common import (
    Dispatch,
    Effect,
    EndpointHost,
    NodeLifecycle,
    NodeRuntime,
    PagesHeld,
    PagesReleased,
    RankEffects,
    RoomClock,
    RoomStatus,
    WriterFenced,
    draw_incarnation,
    loop_time,
    peer_key,
)
from pdflow.io.settings import Settings, load_settings, timeouts_from
from pdflow.trace.format import message_id
from pdflow.transport.base import RotationUnavailableError, Transport, TransportError

log = structlog.get_logger("pdflow.decode")

SMALL_ROOM_RING_ROOMS = 512
"""With small-room staging on, a rank's ring holds this many of the largest small rooms (8 MiB
at the SGLang backend's 16 KiB); a room finding no free region is written directly."""
DP_RANK_POLL_S = 0.01
"""How often the decode asks the registry for a room's DP rank the prefill has not registered
yet (it does so as it opens the room, usually within milliseconds)."""

# How often a rotation looks again for live rooms of the old session (each ends by its own timers).
_DRAIN_POLL_S = 0.02
# After a rotation that failed (the new engine would not start, a region was refused), the
# quarantine threshold asks for the next one only this much later: not one engine per check.
_ROTATION_RETRY_S = 60.0


class RoomRecord(msgspec.Struct, frozen=True):
    """What a verification works on, taken in the step that asked for it: the room id may be
    cleared and opened again (another generation, other pages) before the task runs."""

    pages: tuple[int, ...] | None
    staging_offset: int | None
    state: StateIndices
    writers: tuple[PeerId, ...]


class RotationReport(msgspec.Struct, frozen=True):
    """One fence by engine rotation: the sessions, and what the retirement gave back."""

    old_session: str
    new_session: str
    reason: str
    released_pages: int
    drain_s: float


def request_id(room: int, generation: int) -> str:
    """The admission queue's name for one room instance's request."""
    return f"{request_id_prefix(room)}{generation}"


def request_id_prefix(room: int) -> str:
    """What the ids of every generation of ``room`` start with."""
    return f"{room}/"


class DecodeRank:
    """The engine's handle on one decode rank. Calls the core refuses raise
    ``LocalProtocolError`` / ``InvalidInput`` and change nothing."""

    def __init__(self, node: DecodeNode, host: EndpointHost, kv: RankKv) -> None:
        self._node = node
        self._host = host
        self.kv = kv

    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def peer(self) -> PeerId:
        return self._host.me

    async def open(self, room: int, generation: int, bootstrap: str,
                   prefill_dp_rank: int | None = None) -> None:  # fmt: skip
        """Start receiving ``room`` from the prefill instance registered at ``bootstrap``. Its
        DP group is ``prefill_dp_rank`` if given, else ``room % dp`` when the prefill follows the
        bootstrap room, else the one the prefill registered for the room (/query_dp_ranks)."""
        if prefill_dp_rank is None:
            prefill_dp_rank = await self._node.registered_dp_rank(bootstrap, room)
        # The clock first: with the topology known the room is WaitingForInput within the call,
        # and that moment starts its allocation wait.
        previous = self._host.clocks.get(room)
        self._host.clocks[room] = RoomClock(loop_time(), generation)
        try:
            with self._node.runtime.events.reopening(self.rank, room):
                await self._host.call(OpenReceiver(room, generation, bootstrap, prefill_dp_rank))
        except BaseException:
            if previous is None:
                self._host.clocks.pop(room, None)
            else:
                self._host.clocks[room] = previous
            raise

    async def publish_pages(self, room: int, pages: Sequence[int], *, aux_index: int | None = None,
                            decode_prefix_len: int = 0,
                            state_indices: Sequence[Sequence[int]] = ()) -> None:  # fmt: skip
        """Give the room its destination pages (free ones: see PagesReleased). ``aux_index``:
        the request's row in this rank's aux buffer, filled with the prefill's aux row before
        the room reports Success."""
        if aux_index is not None:
            aux_buffer_of(self.kv, "publish_pages").row(aux_index)
        # Most rooms carry no state: skip the generators that would build an empty tuple.
        state = tuple(tuple(int(i) for i in c) for c in state_indices) if len(state_indices) else ()
        if state:
            check_state_indices(self.kv.state, state, "publish_pages")
        await self._host.call(PublishPages(room, tuple(pages), aux_index, decode_prefix_len,
                                           state))  # fmt: skip
        self._node.room_pages[(self.rank, room)] = tuple(pages)
        self._node.room_state[(self.rank, room)] = state
        clock = self._host.clocks.get(room)
        if clock is not None:
            clock.published_at = loop_time()

    async def admit(self, room: int, *, input_len: int, max_new: int, prefix_len: int = 0) -> int:
        """Wait until the open room's request may take pages; return how many to publish.

        Admitted in FIFO order only while the pages left cover the largest growth any single
        admitted request may still need (core/resources/admission.py), so requests waiting for
        or in transfer, which cannot be retracted, never deadlock the pool. The request keeps
        its pages counted until :meth:`finish_request`, or until pdflow releases the pages of
        its failed room. Raises ``AdmissionRefused`` when it can never fit this pool.
        """
        generation = self._host.endpoint.generation_of(room)
        if generation is None:
            raise LookupError(f"room {room} is not open on rank {self.rank}; open it first")
        if (self.rank, room) in self._node.room_pages:
            # Its pages may be released already: admission would count them for good.
            raise InvalidInput(f"room {room}: admit before publish_pages; its pages are "
                               "published, and rooms published without admit are not "
                               "counted")  # fmt: skip
        return await self._node.admission[self.rank].admit(
            request_id(room, generation), input_len, max_new, prefix_len
        )

    def finish_request(self, room: int, generation: int) -> None:
        """The engine is done with a successful room's request (decoding finished): its pages
        return to the pool admission sees. Naming another generation than the one admitted
        raises ``InvalidInput`` (the admitted request would keep its pages counted); a request
        that is not admitted (never, or its failed room's pages came back) is a no-op. A failed
        room whose published pages pdflow still holds (quarantined: a writer may still land in
        them) raises ``InvalidInput``: its request leaves admission when they are released."""
        gate, rid = self._node.admission[self.rank], request_id(room, generation)
        if self._pdflow_holds_pages(room, generation) and not self._succeeded(room, generation):
            raise InvalidInput(
                f"finish_request({room}, {generation}): the room did not succeed and pdflow "
                "still holds its published pages (quarantined while a writer may still land "
                "in them); its request leaves admission by itself when they come back "
                "(PagesReleased): call finish_request only for a room that succeeded"
            )
        if not gate.is_admitted(rid):
            others = gate.admitted_with_prefix(request_id_prefix(room))
            if others:
                raise InvalidInput(
                    f"finish_request({room}, {generation}): room {room} is admitted as "
                    f"{', '.join(others)} (room/generation), not generation {generation}; pass "
                    "the generation the room was opened with"
                )
        gate.finish(rid)

    def _pdflow_holds_pages(self, room: int, generation: int) -> bool:
        # The ledger is the one record of whose pages pdflow holds: a copy kept by the shell
        # missed the pages a failed room's publish hands straight back (PagesFreed in the
        # publish's own step), and kept refusing that room's finish_request for good.
        state: RoomPagesState = self._host.endpoint.ledger.state_of(room, generation)
        return state is not RoomPagesState.FREE

    def _succeeded(self, room: int, generation: int) -> bool:
        status = self._node.runtime.events.status(self.rank, room)
        return (status is not None and status.generation == generation
                and status.poll is KVPoll.Success)  # fmt: skip

    async def abort(self, room: int, reason: str = "aborted by the engine") -> None:
        await self._host.call(RoomCall(room, AbortRequested(reason)))

    async def clear(self, room: int) -> None:
        await self._host.call(ClearRoom(room))

    def snapshot(self) -> DecodeSnapshot:
        """The endpoint's read-only state (rooms, counters, ledger)."""
        snapshot: DecodeSnapshot = self._host.endpoint.snapshot()
        return snapshot

    def probe_targets(self) -> tuple[ProbeTarget, ...]:
        """What the heartbeat probes for this rank: each prefill instance's own health
        endpoint (or the registry's, for one that registered none), lost ones included."""
        targets: tuple[ProbeTarget, ...] = self._host.endpoint.probe_targets()
        return targets

    def poll(self, room: int) -> KVPoll | None:
        summary = self._host.endpoint.summary(room)
        return None if summary is None else summary.poll

    async def wait(self, room: int, *, terminal: bool = False) -> RoomStatus:
        """Until the room wants pages (WaitingForInput) or later; with ``terminal``, its end."""
        threshold = KVPoll.Success if terminal else KVPoll.WaitingForInput
        return await self._node.runtime.events.wait_status(
            self.rank, room, threshold, is_open=self.poll(room) is not None,
            open_call="DecodeRank.open",
        )  # fmt: skip

    @property
    def allocatable(self) -> int:
        """Pages neither reserved nor quarantined."""
        allocatable: int = self._host.endpoint.allocatable_pages
        return allocatable

    def quarantine(self) -> tuple[QuarantinedRoom, ...]:
        report: tuple[QuarantinedRoom, ...] = self._host.endpoint.quarantine(
            anyio.current_time()
        )
        return report


class DecodeRankEffects(RankEffects):
    """What the node does for one decode rank's outputs (dispatched by carry_out_decode)."""

    role = "decode"

    def __init__(self, node: DecodeNode, host: EndpointHost) -> None:
        super().__init__(host)
        self.node = node

    def send(self, to: PeerId, message: AnyMessage, msg_id: str | None) -> Effect:
        return self.node.send(self.host, to, message, msg_id)

    def forget_room(self, removed: RoomRemoved) -> None:
        key = (self.host.rank, removed.room)
        gate = self.node.admission[self.host.rank]
        rid = request_id(removed.room, removed.generation)
        gate.withdraw(rid)
        if key not in self.node.room_pages:
            gate.finish(rid)  # admitted, but failed before its pages were published
        self.node.room_pages.pop(key, None)
        self.node.room_state.pop(key, None)
        self.node.room_staging.pop(key, None)
        super().forget_room(removed)

    def fetch_topology(self, bootstrap: str) -> None:
        node, host = self.node, self.host
        node.spawn(lambda: node.resolve(host, bootstrap))

    def close_session(self, request: CloseSession) -> None:
        node, host = self.node, self.host
        node.spawn(lambda: node.close_session(host, request.peer, request.session_id))

    async def readmit_writer(self, readmit: ReadmitWriter) -> None:
        # Awaited, not spawned: the fence is lifted before any later output of the step (a
        # room's metadata) can make the writer write.
        await self.node.readmit(self.host, readmit.peer, readmit.session_id)

    def note_superseded(self, superseded: IncarnationSuperseded) -> None:
        self.node.runtime.metrics.superseded.inc()
        log.info("prefill_superseded", endpoint=self.host.endpoint_id,
                 bootstrap=superseded.bootstrap, incarnation=superseded.incarnation)  # fmt: skip

    def verify_checksums(self, request: VerifyChecksums) -> None:
        node, host = self.node, self.host
        key = (host.rank, request.room)
        record = RoomRecord(node.room_pages.get(key), node.room_staging.get(key),
                            node.room_state.get(key, ()),
                            host.endpoint.writers_of(request.room))  # fmt: skip
        node.spawn(lambda: node.verify(host, request, record))

    def store_aux(self, aux: StoreAux) -> None:
        # The core checked the row's size against the rank's aux buffer when it accepted it.
        kv = self.node.rank_of(self.host).kv
        write_aux_row(aux_buffer_of(kv, "a Success"), aux.aux_index, aux.data)

    def note_staging(self, placed: StagingPlaced) -> None:
        self.node.room_staging[(self.host.rank, placed.room)] = placed.offset

    def release_pages(self, freed: PagesFreed) -> None:
        status = self.host.events.status(self.host.rank, freed.room)
        if status is None or status.generation != freed.generation or (
            status.poll is not KVPoll.Success
        ):
            # A failed room's pages: no request will decode on them, admission gets them back.
            # A successful room's stay with the engine until finish_request.
            self.node.admission[self.host.rank].finish(request_id(freed.room, freed.generation))
        self.host.events.publish(
            PagesReleased(self.host.rank, freed.room, freed.generation, freed.pages)
        )
        self.node.update_quarantine()

    def hold_pages(self, held: PagesQuarantined) -> None:
        self.host.events.publish(PagesHeld(
            self.host.rank, held.room, held.generation, held.pages, held.writers
        ))  # fmt: skip
        self.node.update_quarantine()


class DecodeNode(NodeLifecycle):
    """``async with DecodeNode(...) as node``: serve until the block ends, then shut down."""

    def __init__(
        self,
        *,
        ranks: Sequence[RankKv],
        transport: Transport,
        settings: Settings | None = None,
        incarnation: str | None = None,
        is_mla: bool = False,
        executor: Executor | None = None,
        codec: WireCodec | None = None,
        rng: random.Random | None = None,
        staging_bytes: int = 0,
        staging_memory: Mapping[int, EngineMemory] | None = None,
        admission_reserve_tokens: int = NUM_RESERVED_DECODE_TOKENS,
        admission_clip_max_new: int = CLIP_MAX_NEW_TOKENS,
        started_at: float | None = None,
    ) -> None:
        if not ranks:
            raise ValueError("a decode node needs at least one rank")
        self.settings = settings or load_settings()
        self.transport = transport
        self.incarnation = incarnation or draw_incarnation()
        # Wall clock, not monotonic: announced with each rank's layout, it orders this life
        # against a predecessor at the same address, so prefill ranks drop that one's late
        # KvArgs instead of replacing this life's layout with it.
        self.started_at = time.time() if started_at is None else started_at
        self.is_mla = is_mla
        self.rank_kv = list(ranks)
        self.runtime = NodeRuntime("decode", self.settings, self.incarnation,
                                   codec or MsgpackCodec(large_inbound=()))  # fmt: skip
        self._executor = executor
        self._rng = rng or random.Random()
        self._stack = AsyncExitStack()
        self._clients: dict[str, BootstrapClient] = {}
        self._client_users: Counter[str] = Counter()
        """Requests in flight per client address: such a client is never closed as unused."""
        self._writer_place: dict[PeerId, TpPlace] = {}
        self.room_pages: dict[tuple[int, int], tuple[int, ...]] = {}
        self.room_state: dict[tuple[int, int], StateIndices] = {}
        self.ranks: list[DecodeRank] = []
        self._hosts: list[EndpointHost] = []
        self._channels: dict[int, ControlChannel] = {}
        self._registered: list[int] = []
        # Each rank's staging ring: prefill ranks write head slices there (heterogeneous TP),
        # or a small room's pages (small-room staging), in one bulk write per chunk; the node
        # scatters them into pages before Success.
        self._host_memory = in_host_memory(ranks)
        small = self.settings.small_room_staging_bytes if self._host_memory else 0
        self._small_room_bytes = small
        self.staging_bytes = max(staging_bytes, small * SMALL_ROOM_RING_ROOMS)
        self._staging: dict[int, ctypes.Array[ctypes.c_uint8]] = {}
        self.staging_memory = dict(staging_memory or {})
        """Per TP rank, the engine's own staging ring memory; a rank without one gets a host
        ring the node allocates."""
        self._staging_base: dict[int, int] = {}
        self.room_staging: dict[tuple[int, int], int] = {}
        self._regions: dict[tuple[int, TpPlace], WriterRegion | None] = {}
        self._page_bytes: dict[int, int] = {}
        """Per TP rank, the bytes of one page over every buffer."""
        # Decode admission per rank over the rank's whole pool (DecodeRank.admit).
        self._admission_tokens = (admission_reserve_tokens, admission_clip_max_new)
        self.admission: dict[int, AdmissionGate] = {}
        self._rotation_lock = anyio.Lock()
        self._rotation_wanted = False
        self._rotation_failed_at: float | None = None
        self.rotations: list[RotationReport] = []

    async def _start(self) -> None:
        for rank_kv in self.rank_kv:
            if self.staging_bytes:
                lent = self.staging_memory.get(rank_kv.tp_rank)
                if lent is None:
                    ring = (ctypes.c_uint8 * self.staging_bytes)()
                    self._staging[rank_kv.tp_rank] = ring
                    base = ctypes.addressof(ring)
                else:
                    lent.check_holds(self.staging_bytes, "the staging ring")
                    base = lent.addr
                self._staging_base[rank_kv.tp_rank] = base
                self.transport.register_buffer(base, self.staging_bytes)
                self._registered.append(base)
            self._add_rank(rank_kv, self.runtime.open_channel())
            for addr, size in rank_kv.buffers():
                self.transport.register_buffer(addr, size)
                self._registered.append(addr)
        if (self.settings.checksum or self.staging_bytes) and self._executor is None:
            self._executor = executor_for(self.rank_kv)
        self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
        metrics = self.runtime.metrics
        gates = self.admission.values()
        metrics.admission_queued.set_function(lambda: sum(g.queued for g in gates))
        metrics.admission_admitted.set_function(lambda: sum(g.admitted for g in gates))
        await self._serve_metrics()
        for host in self._hosts:
            channel = self._channels[host.rank]
            self._tasks.start_soon(host.run_timer)
            self._tasks.start_soon(channel.receive_forever, self._deliverer(host))
        self._tasks.start_soon(run_heartbeat, self.settings.heartbeat_interval,
                               self._probe_targets, self._probe, self._heartbeat)  # fmt: skip
        log.info("decode_node_ready", node=self.runtime.node_id,
                 ranks=[h.me.address for h in self._hosts])  # fmt: skip

    def _add_rank(self, rank_kv: RankKv, channel: ControlChannel) -> None:
        self._page_bytes[rank_kv.tp_rank] = staging_page_bytes(rank_kv.kv_buffers)
        layout = rank_kv.layout
        me = PeerId(channel.address, self.incarnation, rank_kv.tp_rank)
        config = DecodeEndpointConfig(
            me=me, tp_size=rank_kv.tp_size, tp_rank=rank_kv.tp_rank,
            num_kv_heads=rank_kv.total_kv_heads, num_pages=layout.num_pages,
            page_size=layout.page_size, kv_cache_dtype=layout.dtype.value, is_mla=self.is_mla,
            session_id=self.transport.session_id, policy=self.settings.allocation_policy,
            timeouts=timeouts_from(self.settings),
            heartbeat_max_failure=self.settings.heartbeat_max_failure,
            lost_instance_forget_s=self.settings.lost_instance_forget,
            verify_checksums=self.settings.checksum,
            staging_capacity=self.staging_bytes,
            # The small-room path copies with memmove: host-memory KV only.
            stage_rooms_up_to=self._small_room_bytes,
            staging_page_bytes=self._page_bytes[rank_kv.tp_rank],
            kv_layout=rank_kv.kv_buffers, staging_addr=self._staging_addr(rank_kv.tp_rank),
            aux_row_bytes=0 if rank_kv.aux is None else rank_kv.aux.row_bytes,
            state=rank_kv.state, started_at=self.started_at,
        )  # fmt: skip
        endpoint_id = self.runtime.endpoint_id(rank_kv.tp_rank)
        core = DecodeEndpoint(config)
        self._refuse_a_layout_prefills_drop(core, me)
        self._refuse_an_aux_row_no_success_carries(rank_kv, me)
        endpoint = self.runtime.recorder.wrap(endpoint_id, core)
        host = EndpointHost(endpoint_id, endpoint, rank_kv.tp_rank, me, self._dispatcher,
                            self.runtime.metrics, self.runtime.events)  # fmt: skip
        self._hosts.append(host)
        reserve, clip = self._admission_tokens
        self.admission[rank_kv.tp_rank] = AdmissionGate(AdmissionBudget(
            pool_pages=layout.num_pages, page_size=layout.page_size, reserve_tokens=reserve,
            clip_max_new=clip,
        ))  # fmt: skip
        self._channels[rank_kv.tp_rank] = channel
        self.ranks.append(DecodeRank(self, host, rank_kv))

    def _refuse_a_layout_prefills_drop(self, endpoint: DecodeEndpoint, me: PeerId) -> None:
        """A layout over control_max_layout_bytes would be dropped by every prefill rank
        (``layout_too_large``) and each room would fail late: refuse to start instead."""
        announced = endpoint.announcement(me)  # its own address stands for a prefill rank's
        limit = self.settings.control_max_layout_bytes
        if announced is not None and layout_bytes(announced) > limit:
            raise InvalidInput(
                f"decode rank {me.rank}'s KV layout ({len(announced.layout.buffers)} buffers, "
                f"{len(announced.state)} state components) encodes to "
                f"{layout_bytes(announced)} bytes, over control_max_layout_bytes ({limit}), so "
                "prefill ranks would drop it; raise PDFLOW_CONTROL_MAX_LAYOUT_BYTES on every "
                "node (at most the codec's max_message_bytes)"
            )

    def _refuse_an_aux_row_no_success_carries(self, rank_kv: RankKv, me: PeerId) -> None:
        """A prefill's Success carries the room's aux row in one small message: a row that
        cannot fit this decode's inbound frame limit is refused by every prefill's sender (and
        would be cut by this decode's ZMQ), so each room would wait out waiting_timeout for a
        Success that never comes: refuse to start instead."""
        if rank_kv.aux is None:
            return
        # The largest Success such a row travels in: the longest prefill address a DNS name
        # allows, the largest integers the wire takes, and the longest message id they give.
        prefill = PeerId(f"{'p' * 253}:65535", self.incarnation, WIRE_INT_MAX)
        success = StatusReport(WIRE_INT_MAX, WIRE_INT_MAX, KVPoll.Success, prefill, me,
                               checksum=2**64 - 1, aux=bytes(rank_kv.aux.row_bytes))  # fmt: skip
        msg_id = message_id(f"prefill-{self.incarnation}#{WIRE_INT_MAX}", WIRE_INT_MAX, 2**16)
        size = len(wire_frames(msgspec.msgpack.encode(success), msg_id.encode())[0])
        limit = self.runtime.codec.max_inbound_frame_bytes
        if size > limit:
            raise InvalidInput(
                f"decode rank {me.rank}'s aux row ({rank_kv.aux.row_bytes} bytes in "
                f"{len(rank_kv.aux.item_lens)} buffers) makes a room's Success up to {size} "
                f"bytes, over the {limit}-byte limit of a small control message, so no room "
                "could succeed; give the engine smaller aux (metadata) buffers"
            )

    def _staging_addr(self, rank: int) -> int | None:
        return self._staging_base.get(rank)

    async def _release(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        for addr in self._registered:
            try:
                self.transport.unregister_buffer(addr)
            except TransportError as exc:
                log.warning("unregister_failed", addr=hex(addr), error=str(exc))
        self._registered.clear()
        self.runtime.close()

    # ---- receiving -----------------------------------------------------------------------------
    def _deliverer(self, host: EndpointHost) -> Deliver:
        async def deliver(message: ControlMessage, msg_id: str | None) -> None:
            await host.feed(Received(message, msg_id))

        return deliver

    # ---- outputs -------------------------------------------------------------------------------
    def _dispatcher(self, host: EndpointHost) -> Dispatch:
        effects: DecodeEffects[Effect] = DecodeRankEffects(self, host)
        return partial(carry_out_decode, effects)

    def spawn(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Work an output asked for that answers with a later input (never under the lock)."""
        self._tasks.start_soon(job)

    def send(self, host: EndpointHost, to: PeerId, message: AnyMessage,
             msg_id: str | None) -> Effect:  # fmt: skip
        """Queue the message now, or the awaitable that waits for room in the peer's queue (the
        step awaits it before its next output). One channel per rank, in step order: the core's
        KvArgs precedes the messages it announces."""
        sent = self._channels[host.rank].send_soon(to.address, message, msg_id)
        return None if isinstance(sent, bool) else sent

    def rank_of(self, host: EndpointHost) -> DecodeRank:
        return self.ranks[self._hosts.index(host)]

    def update_quarantine(self) -> None:
        """Refresh the quarantine gauges: O(ranks) per release, never a walk over the rooms."""
        pages = sum(host.endpoint.quarantined_pages for host in self._hosts)
        since = [host.endpoint.oldest_fenced_at() for host in self._hosts]
        fenced = [at for at in since if at is not None]
        oldest_age = anyio.current_time() - min(fenced) if fenced else 0.0
        staging = sum(host.endpoint.quarantined_staging_bytes for host in self._hosts)
        self.runtime.metrics.quarantine(pages, oldest_age, staging)
        if self._wants_rotation():
            self._rotation_wanted = True
            self.spawn(lambda: self._rotate_when_wanted("quarantine_threshold"))

    def _wants_rotation(self) -> bool:
        """Pages held only for dead writers past the setting, or any staging-ring region held
        only for dead writers, on any rank: only a rotation gives them back on a transport
        without a per-peer fence. A ring region has no size threshold: however small, it pins
        the ring's watermark, so every staged room behind it waits and fails (chaos finding 6)."""
        percent = self.settings.rotate_quarantine_percent
        if not percent or self._rotation_wanted or not self.transport.can_rotate:
            return False
        failed_at = self._rotation_failed_at
        if failed_at is not None and anyio.current_time() < failed_at + _ROTATION_RETRY_S:
            return False
        for host in self._hosts:
            endpoint = host.endpoint
            limit = percent / 100 * endpoint.config.num_pages
            if not endpoint.quarantined_pages:  # O(1): walk the fenced rooms only past it
                continue
            if endpoint.quarantined_staging_bytes and endpoint.dead_held_staging_bytes:
                return True
            if endpoint.quarantined_pages > limit and endpoint.dead_held_pages > limit:
                return True
        return False

    async def _rotate_when_wanted(self, reason: str) -> None:
        """A rotation the quarantine asked for. One that fails leaves the pages quarantined
        (nothing was retired, so nothing is released) and the node serving: raising here
        would end every room of the node."""
        try:
            await self.reclaim_quarantine(reason=reason)
        except Exception as exc:
            self._rotation_failed_at = anyio.current_time()
            self.runtime.metrics.session_rotations.labels("failed").inc()
            log.error("session_rotation_failed", node=self.runtime.node_id, reason=reason,
                      error=f"{type(exc).__name__}: {exc}",
                      retry_in_s=_ROTATION_RETRY_S)  # fmt: skip
        finally:
            self._rotation_wanted = False

    async def reclaim_quarantine(self, *, reason: str = "requested") -> RotationReport:
        """Fence by engine rotation: release every page quarantined for writers that never
        drain (a killed prefill), on a transport that cannot fence one peer.

        Opens a new engine with the same memory registered and hands its session to every rank
        (rooms opened from now on, and rooms not yet published, use it; the layout is announced
        again). Live rooms of the old session are never cut: they finish or fail by their own
        timers. Once none is left the old engine is destroyed, so no write of any writer
        through it can land, and only then the ranks are told (SessionRetired) and free every
        fenced room published under it. Raises ``RotationUnavailableError`` where the transport
        cannot rotate.
        """
        if not self.transport.can_rotate:
            raise RotationUnavailableError(
                f"{type(self.transport).__name__} cannot rotate its engine; its quarantined "
                "pages wait for their writers' drain ACKs"
            )
        async with self._rotation_lock:
            old = self.transport.session_id
            new = await self.transport.rotate()
            for host in self._hosts:
                await host.call(SessionRotated(new))
            held = sum(host.endpoint.quarantined_pages for host in self._hosts)
            log.info("session_rotated", node=self.runtime.node_id, old_session=old,
                     new_session=new, reason=reason, quarantined_pages=held)  # fmt: skip
            started = anyio.current_time()
            while any(host.endpoint.live_rooms_on(old) for host in self._hosts):
                await anyio.sleep(_DRAIN_POLL_S)
            drain_s = anyio.current_time() - started
            await self.transport.retire(old)  # its io thread joined, its connections closed
            released = 0
            for host in self._hosts:
                before = host.endpoint.quarantined_pages
                await host.call(SessionRetired(old))
                released += before - host.endpoint.quarantined_pages
            report = RotationReport(old, new, reason, released, drain_s)
            self.rotations.append(report)
            self.runtime.metrics.session_rotations.labels(reason).inc()
            self.runtime.metrics.rotation_released_pages.inc(released)
            log.info("session_retired", node=self.runtime.node_id,
                     **msgspec.structs.asdict(report))  # fmt: skip
            self.update_quarantine()
            return report

    # ---- topology ------------------------------------------------------------------------------
    def _client(self, bootstrap: str) -> BootstrapClient:
        client = self._clients.get(bootstrap)
        if client is None:
            client = BootstrapClient(bootstrap, rng=self._rng, token=self.settings.bootstrap_token)
            self._clients[bootstrap] = client
        return client

    @contextmanager
    def _client_kept(self, address: str) -> Iterator[None]:
        """While the block runs, the client of ``address`` is not closed as unused."""
        self._client_users[address] += 1
        try:
            yield
        finally:
            self._client_users[address] -= 1
            if not self._client_users[address]:
                del self._client_users[address]

    def _close_unused_clients(self, probed: set[str]) -> None:
        """Close the client of every address no longer probed, asked for a topology, nor in
        use: a prefill given up or replaced. Without it the cache kept a client for every
        prefill an elastic cluster ever had."""
        in_use = probed.union(self._client_users, *(
            host.endpoint.bootstraps_in_use() for host in self._hosts))  # fmt: skip
        for address in set(self._clients) - in_use:
            self._tasks.start_soon(self._clients.pop(address).aclose)

    async def registered_dp_rank(self, bootstrap: str, room: int) -> int | None:
        with self._client_kept(bootstrap):
            return await self._registered_dp_rank(bootstrap, room)

    async def _registered_dp_rank(self, bootstrap: str, room: int) -> int | None:
        """The DP group the prefill registered for ``room``, waiting for the registration up to
        the bootstrap timeout; None when the prefill's DP groups follow the bootstrap room, or
        when its topology is not known yet (the endpoint then refuses to guess for a prefill
        that turns out not to follow the room)."""
        client = self._client(bootstrap)
        server = client.known_topology()
        if server is None:
            try:  # one attempt: opening a room never waits for the registry to be ready
                server = await client.get_topology(deadline_s=0.0)
            except BootstrapError:
                return None
        if server.dp_size == 1 or server.follow_bootstrap_room:
            return None
        deadline = anyio.current_time() + self.settings.bootstrap_timeout
        while True:
            found = (await client.query_dp_ranks([room])).get(room)
            if found is not None:
                return found
            if anyio.current_time() >= deadline:
                raise BootstrapError(
                    f"the prefill registry at {bootstrap} names no DP rank for room {room} after "
                    f"{self.settings.bootstrap_timeout:g}s; the prefill registers it when it "
                    "opens the room (POST /register_dp_rank)"
                )
            await anyio.sleep(DP_RANK_POLL_S)

    async def resolve(self, host: EndpointHost, bootstrap: str) -> None:
        try:
            with self._client_kept(bootstrap):
                info = await self._fetch_topology(bootstrap)
        except (BootstrapError, ValueError) as exc:
            await host.feed(TopologyFailed(bootstrap, str(exc)))
            return
        await host.feed(TopologyKnown(info))

    async def _fetch_topology(self, bootstrap: str) -> PrefillInfo:
        client = self._client(bootstrap)
        server = await client.get_topology(deadline_s=self.settings.bootstrap_timeout)
        if server.page_size is None or server.kv_cache_dtype is None:
            raise BootstrapError(f"the registry at {bootstrap} reports no page size or KV dtype")
        parallel = Parallelism(tp=server.attn_tp_size, cp=server.attn_cp_size,
                               pp=server.pp_size, dp=server.dp_size)  # fmt: skip
        ranks = []
        answers = []
        for dp in range(server.dp_size):
            for cp in range(server.attn_cp_size):
                for tp in range(server.attn_tp_size):
                    for pp in range(server.pp_size):
                        found = await client.get_rank(dp, cp, tp, pp)
                        answers.append(found)
                        unique = prefill_unique_rank(parallel, tp_rank=tp, pp_rank=pp, cp_rank=cp)
                        peer = PeerId(f"{found.rank_ip}:{found.rank_port}",
                                      found.incarnation or "", unique)  # fmt: skip
                        ranks.append(RegisteredPrefillRank(dp, cp, tp, pp, peer, found.health))
        # The prefill's own attention kind, as its ranks registered it: the endpoint refuses a
        # mismatch. A prefill that declared none (SGLang's) is taken to match this decode.
        declared = declared_is_mla(answers)
        is_mla = self.is_mla if declared is None else declared
        for registered in ranks:
            self._writer_place[registered.peer] = TpPlace(server.attn_tp_size, registered.tp)
        return PrefillInfo(
            bootstrap=bootstrap, tp_size=server.attn_tp_size, cp_size=server.attn_cp_size,
            pp_size=server.pp_size, dp_size=server.dp_size, page_size=server.page_size,
            kv_cache_dtype=server.kv_cache_dtype, policy=server.decode_allocation_policy,
            ranks=tuple(ranks), is_mla=is_mla,
            follow_bootstrap_room=server.follow_bootstrap_room,
            checksum=declared_checksum(answers),
            staging_slot_bytes=declared_staging_slot_bytes(answers),
        )  # fmt: skip

    # ---- heartbeat -----------------------------------------------------------------------------
    def _probe_targets(self) -> set[ProbeTarget]:
        targets = {target for host in self._hosts for target in host.endpoint.probe_targets()}
        self._close_unused_clients({target.key for target in targets})
        return targets

    async def _probe(self, target: ProbeTarget) -> HealthStatus:
        with self._client_kept(target.key):
            status = await self._client(target.key).health()
        if not status.ok:
            self.runtime.metrics.heartbeat_failures.labels(target.key).inc()
        return status

    async def _heartbeat(self, result: HeartbeatResult) -> None:
        target = ProbeTarget(result.bootstrap, result.health)
        for host in self._hosts:
            if target in host.endpoint.probe_targets():
                await host.feed(result)

    # ---- dead writers and checksums ------------------------------------------------------------
    async def close_session(self, host: EndpointHost, peer: PeerId, session: str | None) -> None:
        """Fence a writer the core declared dead, on this process's own receiving side.

        SessionClosed lets the core free the writer's quarantined pages, so it is handed over
        only once a real fence has returned. Without one (or without the writer's session id)
        the pages wait for its drain ACK, and its channel is kept so the ABORTs reach it.
        """
        if host.endpoint.ledger.verdict_lifted(peer):
            return  # readmitted before this task ran: no verdict left to enforce
        if session is None or not self.transport.fence_is_real:
            why = ("its transport session is unknown" if session is None
                   else "the transport has no receiver-side fence")  # fmt: skip
            then = (" or an engine rotation (reclaim_quarantine)" if self.transport.can_rotate
                    else "")  # fmt: skip
            log.warning("writer_not_fenced", endpoint=host.endpoint_id, writer=peer_key(peer),
                        reason=f"{why}; its pages stay quarantined until its drain ACK{then}")
            # The writer's held pages now count as dead-held: the rotation threshold may be
            # passed with no page held or released after this (chaos finding 6).
            self.update_quarantine()
            return
        # The channel stays: a writer declared dead may only be paused, and the ABORTs it must
        # drain and ACK before it can be readmitted have to reach it.
        await self.transport.fence(session)
        self.runtime.events.publish(WriterFenced(host.rank, peer))
        await host.feed(SessionClosed(peer))

    async def readmit(self, host: EndpointHost, peer: PeerId, session: str | None) -> None:
        """A writer wrongly declared dead answered and drained: lift this process's fence for
        the writes it starts from now on (earlier ones stay refused by the transport)."""
        lifted = False
        if session is not None and self.transport.fence_is_real:
            await self.transport.lift_fence(session)
            lifted = True
        self.runtime.metrics.readmitted.inc()
        log.info("writer_readmitted", endpoint=host.endpoint_id, writer=peer_key(peer),
                 fence_lifted=lifted)  # fmt: skip

    async def verify(self, host: EndpointHost, request: VerifyChecksums,
                     record: RoomRecord) -> None:  # fmt: skip
        """Scatter (staged decode) and check the room's pages, then report, on every path: the
        core holds the pages until this answer, since the scatter writes them.

        The worker thread is joined even when the task is cancelled (anyio waits for it), so
        the answer always comes after the last byte the scatter wrote."""
        reason = "the local verification was cancelled"
        try:
            if self._finishes_inline(host.rank, request, record):
                reason = self._mismatch(host.rank, request, record, inline=True)
            else:
                reason = await anyio.to_thread.run_sync(
                    self._mismatch, host.rank, request, record
                )
        except Exception as exc:
            reason = f"the local verification failed: {type(exc).__name__}: {exc}"
            log.error("verify_failed", endpoint=host.endpoint_id, room=request.room,
                      generation=request.generation, error=reason)  # fmt: skip
        finally:
            with anyio.CancelScope(shield=True):
                await host.feed(
                    ChecksumChecked(request.room, request.generation, not reason, reason)
                )

    def _finishes_inline(self, rank: int, request: VerifyChecksums, record: RoomRecord) -> bool:
        """A small staged room in host memory with no digest to recompute is scattered on the
        loop: a few copies cost less than a hop to a worker thread."""
        pages = record.pages
        return (
            not request.expected
            and pages is not None
            and self._host_memory
            and len(pages) * self._page_bytes[rank] <= SMALL_ROOM_STAGING_LIMIT
        )

    def _scatter(self, rank: int, kv: RankKv, pages: tuple[int, ...], offset: int,
                 writers: tuple[PeerId, ...], inline: bool) -> None:  # fmt: skip
        """Move each writer's staged slices of the room into the room's pages (``inline``: by
        host copies on this thread, else with the node's executor)."""
        base = self._staging_base[rank] + offset
        for writer in writers:
            region = self._region(kv, self._writer_place[writer])
            if region is None:
                continue
            where = base + region.chunk_offset(len(pages), 0)
            if inline:
                copy_staged_host(region, pages, where, gather=False)
            elif self._executor is not None:
                for page_slices in staged_slices(region, pages, where):
                    self._executor.scatter(page_slices)

    def _region(self, kv: RankKv, writer: TpPlace) -> WriterRegion | None:
        """Where a writer at ``writer`` puts its slices in this rank's staging regions; the
        same for every room, so worked out once per (rank, writer place)."""
        key = (kv.tp_rank, writer)
        if key not in self._regions:
            own = kv.kv_buffers
            self._regions[key] = writer_region(own, False, writer, kv.tp, own)
        return self._regions[key]

    def _mismatch(self, rank: int, request: VerifyChecksums, record: RoomRecord,
                  inline: bool = False) -> str:  # fmt: skip
        """Empty when every writer's digest matches the bytes in this room's pages, after the
        scatter of a staged room."""
        pages = record.pages
        kv = self.rank_kv[[r.tp_rank for r in self.rank_kv].index(rank)]
        if pages is None or self._executor is None:
            return "the node has no record of this room's pages; cannot verify"
        if record.staging_offset is not None:
            self._scatter(rank, kv, pages, record.staging_offset, record.writers, inline)
        problems = []
        # The writers of one TP rank (one per pipeline stage) fill that rank's slices of every
        # layer between them: their digests add up to the digest of those slices.
        by_place: dict[TpPlace, list[tuple[PeerId, int]]] = {}
        for peer, expected in request.expected:
            place = self._writer_place.get(peer)
            if place is None:
                problems.append(f"{peer.address}#{peer.rank}: its TP rank is unknown here")
                continue
            by_place.setdefault(place, []).append((peer, expected))
        if not by_place:
            return "; ".join(problems)
        own = kv.kv_buffers  # built per call: asked only when a digest is to be checked
        for place, sent in by_place.items():
            slices = destination_slices(own, place, kv.tp)
            state = record.state
            cuts = state_slices(kv.state, False, place, kv.tp) if state else ()
            actual = (kv_digest(self._executor, slices, pages, pages, own.num_pages)
                      + state_digest(self._executor, cuts, state, state)) % ROOM_FOLD_MODULUS
            expected = sum(digest for _, digest in sent) % ROOM_FOLD_MODULUS
            if actual != expected:
                names = ", ".join(f"{peer.address}#{peer.rank}" for peer, _ in sent)
                problems.append(f"{names}: sent {expected:#x}, received {actual:#x}")
        return "; ".join(problems)
