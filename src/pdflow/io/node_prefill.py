"""PrefillNode: the prefill ranks of one process, each a core PrefillEndpoint, run for real.

It binds one control socket per rank, registers the ranks (with this process's incarnation)
with the bootstrap registry (hosting that registry itself unless told otherwise), executes the
core's outputs (messages, KV writes through the transport) and feeds results back as inputs.
The engine drives rooms through :class:`PrefillRank` and watches :class:`~pdflow.io.node_common.
NodeEvent`s; see docs/embedding.md.
"""

from __future__ import annotations

import ctypes
import random
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Protocol

import anyio
import anyio.to_thread
import msgspec
import structlog

from pdflow.core.cluster.registration import (
    RanksProbed,
    RegisterAgain,
    RegistrationAnswered,
    RegistrationKeeper,
)
from pdflow.core.cluster.registry import RegisterRank
from pdflow.core.cluster.topology import Parallelism, prefill_unique_rank
from pdflow.core.dataplane.buffers import exchanged_slices
from pdflow.core.dataplane.checksum import ROOM_FOLD_MODULUS
from pdflow.core.dataplane.planning import (
    WriteOp,
    pages_after_prefix,
    partition_chunks,
)
from pdflow.core.endpoints.effects import PrefillEffects, carry_out_prefill
from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    OpenRoom,
    PrefillEndpointConfig,
    Received,
    RoomCall,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint, PrefillSnapshot
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import (
    AbortRequested,
    InitTransfer,
    PrefillCompleted,
    SendChunk,
    TransferCompleted,
)
from pdflow.core.protocol.messages import PROTOCOL_VERSION, AnyMessage, KvArgs, PeerId
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.core.resources.staging_ring import SMALL_ROOM_STAGING_LIMIT
from pdflow.core.rooms.sender_room import SenderState
from pdflow.dataplane.executor import Executor
from pdflow.io.bootstrap_client import (
    BootstrapClient,
    BootstrapError,
    BootstrapUnavailable,
    RankNotFound,
)
from pdflow.io.bootstrap_server import serve
from pdflow.io.codec import ControlMessage, MsgpackCodec, WireCodec
from pdflow.io.control import ControlChannel, Deliver
from pdflow.io.health_server import serve_health
from pdflow.io.kv_buffers import (
    EngineMemory,
    RankKv,
    TransferPlanner,
    WriterRegion,
    aux_buffer_of,
    check_state_indices,
    copy_staged_host,
    executor_for,
    in_host_memory,
    kv_digest,
    peer_place,
    plan_state,
    read_aux_row,
    staged_slices,
    state_digest,
    state_slices,
)
from pdflow.io.limits import PrefillRankLimits
from pdflow.io.node_common import (
    Dispatch,
    Effect,
    EndpointHost,
    Job,
    NodeLifecycle,
    NodeRuntime,
    RankEffects,
    RoomClock,
    RoomStatus,
    TransferQueues,
    draw_incarnation,
    loop_time,
    peer_key,
    wedged_ranks,
)
from pdflow.io.settings import Settings, load_settings, timeouts_from
from pdflow.transport.base import Transport, TransportError

log = structlog.get_logger("pdflow.prefill")

_NOT_SUBMITTED = (
    "not submitted: the room failed or was aborted while this chunk waited in its transfer "
    "queue, so none of its bytes was written"
)


FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"


class SourceReady(Protocol):
    """An engine's readiness of a chunk's source bytes, e.g. ``torch.cuda.Event``."""

    def synchronize(self) -> None:
        """Block until the bytes are written."""


class PrefillPlacement(msgspec.Struct, frozen=True):
    """Where a node's TP ranks sit in their prefill instance: its DP group and CP rank (SGLang
    runs one scheduler per pair, so one node each). With DP > 1 a room is served by DP group
    ``room % dp_size`` (``follow_bootstrap_room``, SGLang's default), or, under another load
    balancing method, by the group whose node registered it (``/register_dp_rank``)."""

    dp_size: int = 1
    dp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    load_balance_method: str | None = None
    pp_size: int = 1
    pp_rank: int = 0
    """The pipeline stage: its ranks hand pdflow only the layers they hold (KvBuffers with
    those layer ids) and write only those; the decode waits for every stage."""

    def __post_init__(self) -> None:
        for name, size, rank in (("dp", self.dp_size, self.dp_rank),
                                 ("cp", self.cp_size, self.cp_rank),
                                 ("pp", self.pp_size, self.pp_rank)):  # fmt: skip
            if size < 1 or not 0 <= rank < size:
                raise InvalidInput(f"{name}_rank {rank} is outside [0, {name}_size={size})")

    @property
    def follows_bootstrap_room(self) -> bool:
        return self.load_balance_method in (None, FOLLOW_BOOTSTRAP_ROOM)

    def refusal(self, room: int) -> str:
        """Why this DP group may not serve ``room`` under follow_bootstrap_room ('' if it may)."""
        if self.dp_size == 1 or not self.follows_bootstrap_room or room % self.dp_size == (
            self.dp_rank
        ):
            return ""
        return (
            f"room {room} belongs to prefill DP rank {room % self.dp_size} (room % dp_size="
            f"{self.dp_size}, follow_bootstrap_room), not to this node's DP rank "
            f"{self.dp_rank}; route it there, or run with another load_balance_method so "
            "the node registers the room's DP rank"
        )


class PrefillRank:
    """The engine's handle on one prefill rank. Calls the core refuses raise
    ``LocalProtocolError`` / ``InvalidInput`` and change nothing."""

    def __init__(self, node: PrefillNode, host: EndpointHost) -> None:
        self._node = node
        self._host = host

    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def peer(self) -> PeerId:
        return self._host.me

    async def open_room(self, room: int, generation: int) -> None:
        node = self._node
        refusal = node.placement.refusal(room)
        if refusal:
            raise InvalidInput(refusal)
        if node.placement.dp_size > 1 and not node.placement.follows_bootstrap_room and (
            self.rank == node.rank_kv[0].tp_rank
        ):
            # The decode asks the registry which DP group serves the room (/query_dp_ranks).
            # Before the open: if the registry cannot be reached nothing is open, and the
            # engine may retry the same id and generation (a decode message that comes before
            # the open waits for it, as without DP).
            await node.register_dp_rank(room)
        with node.runtime.events.reopening(self.rank, room):
            await self._host.call(OpenRoom(room, generation))
        self._node.limits[self.rank].early.opened(room)
        self._host.clocks[room] = RoomClock(loop_time(), generation)

    async def init_transfer(self, room: int, num_pages: int, aux_index: int | None = None) -> None:
        """``aux_index``: the request's row in this rank's aux buffer; the engine fills it (first
        token, ...) before the last chunk, and pdflow moves it into the decode's aux slot."""
        if aux_index is not None:
            aux_buffer_of(self._node.rank_kv[self._node.rank_index(self.rank)],
                          "init_transfer").row(aux_index)  # fmt: skip
        await self._host.call(RoomCall(room, InitTransfer(num_pages, aux_index)))

    def decode_prefix_len(self, room: int) -> int:
        """Tokens the decode already holds for this room (known from WaitingForInput on)."""
        summary = self._host.endpoint.summary(room)
        return 0 if summary is None else summary.decode_prefix_len

    async def send_sequence(self, room: int, pages: Sequence[int], *, num_tokens: int,
                            chunk_tokens: int, aux_index: int | None = None,
                            state_indices: Sequence[Sequence[int]] = (),
                            ready: SourceReady | None = None) -> int:  # fmt: skip
        """Send a sequence's KV (``pages[i]`` holds its tokens ``[i, i + 1) * page_size``) in
        chunks of at most ``chunk_tokens``, skipping the pages the decode already holds
        (its ``decode_prefix_len``); returns how many pages were sent. Call at WaitingForInput."""
        page_size = self._node.rank_kv[self._node.rank_index(self.rank)].layout.page_size
        prefix = self.decode_prefix_len(room)
        send = pages_after_prefix(num_tokens, prefix, page_size)
        if len(pages) < send.stop:
            raise InvalidInput(
                f"room {room}: {num_tokens} tokens fill {send.stop} pages but {len(pages)} given"
            )
        chunks = partition_chunks(num_tokens, page_size, chunk_tokens, prefix)
        to_send = list(pages[send.start : send.stop])
        await self.init_transfer(room, len(to_send), aux_index)
        for chunk in chunks:
            await self.send_chunk(room, to_send[chunk.start : chunk.stop], chunk.is_last,
                                  state_indices if chunk.is_last else (), ready=ready)  # fmt: skip
        return len(to_send)

    async def send_chunk(self, room: int, src_pages: Sequence[int], is_last: bool,
                         state_indices: Sequence[Sequence[int]] = (),
                         ready: SourceReady | None = None) -> None:  # fmt: skip
        """``state_indices`` (last chunk): the request's index list per model-state component
        of this rank (``RankKv.state``), e.g. its Mamba slot and its sliding-window pages.
        ``ready``: what says the chunk's source bytes are written (SGLang's CUDA event after
        the forward pass: anything with a blocking ``synchronize()``); the shell waits on it,
        in a worker thread, before it reads the room's pages, state or aux row."""
        # Most chunks carry no state: skip the generators that would build an empty tuple.
        state = (
            tuple(tuple(int(i) for i in c) for c in state_indices) if len(state_indices) else ()
        )
        if state:
            kv = self._node.rank_kv[self._node.rank_index(self.rank)]
            check_state_indices(kv.state, state, "send_chunk")
        key, sources, previous = (self.rank, room), self._node.source_ready, None
        if ready is not None:
            # The latest event of a room covers its earlier chunks (one stream, in order). Set
            # before the call: the chunk's write may start before the call returns.
            previous = sources.get(key)
            sources[key] = ready
        try:
            await self._host.call(RoomCall(room, SendChunk(tuple(src_pages), is_last, state)))
        except BaseException:
            if ready is not None:  # a refused chunk changes nothing
                if previous is None:
                    sources.pop(key, None)
                else:
                    sources[key] = previous
            raise

    async def prefill_completed(self, room: int) -> None:
        await self._host.call(RoomCall(room, PrefillCompleted()))

    async def abort(self, room: int, reason: str = "aborted by the engine") -> None:
        await self._host.call(RoomCall(room, AbortRequested(reason)))

    async def clear(self, room: int) -> None:
        await self._host.call(ClearRoom(room))
        self._node.source_ready.pop((self.rank, room), None)

    def snapshot(self) -> PrefillSnapshot:
        """The endpoint's read-only state (rooms, counters)."""
        snapshot: PrefillSnapshot = self._host.endpoint.snapshot()
        return snapshot

    def transfer_stats(self, room: int) -> tuple[int | None, float | None]:
        """Bytes this rank wrote for the room and the transport's time for them (None when
        the transport could not measure); call before ``clear``."""
        clock = self._host.clocks.get(room)
        if clock is None:
            return None, None
        return clock.bytes_moved, clock.transfer_s

    def poll(self, room: int) -> KVPoll | None:
        """The room's status now; None when the room is not open."""
        summary = self._host.endpoint.summary(room)
        return None if summary is None else summary.poll

    async def wait(self, room: int, *, terminal: bool = False) -> RoomStatus:
        """Until the room is ready for input (or past it), or with ``terminal`` until it ends."""
        threshold = KVPoll.Success if terminal else KVPoll.WaitingForInput
        return await self._node.runtime.events.wait_status(
            self.rank, room, threshold, is_open=self.poll(room) is not None,
            open_call="PrefillRank.open_room",
        )  # fmt: skip


class PrefillRankEffects(RankEffects):
    """What the node does for one prefill rank's outputs (dispatched by carry_out_prefill)."""

    role = "prefill"

    def __init__(self, node: PrefillNode, host: EndpointHost) -> None:
        super().__init__(host)
        self.node = node

    def send(self, to: PeerId, message: AnyMessage, msg_id: str | None) -> Effect:
        sent = self.node.channel_of(self.host).send_soon(to.address, message, msg_id)
        return None if isinstance(sent, bool) else sent

    def start_transfer(self, start: StartTransfer) -> None:
        node, host = self.node, self.host
        # The layout as the core knows it in this step (a later announcement may replace it).
        layout = host.endpoint.layout_of(start.peer)
        # A partial, not a lambda: no closure cells kept per queued room.
        node.queue_transfer(peer_key(start.peer), partial(node.transfer, host, start, layout))


class StagedWrite(msgspec.Struct, frozen=True):
    """A staged chunk: gather this rank's slices of ``pages`` into the local slot, then these
    writes."""

    region: WriterRegion
    pages: tuple[int, ...]
    slot: int
    write_ops: tuple[WriteOp, ...]
    inline: bool
    """Gathered on the loop: a few host-memory copies cost less than a hop to a thread."""

    def gather(self, executor: Executor) -> None:
        for page in staged_slices(self.region, self.pages, self.slot):
            executor.gather(page)


class PrefillNode(NodeLifecycle):
    """``async with PrefillNode(...) as node``: serve until the block ends, then shut down."""

    def __init__(
        self,
        *,
        ranks: Sequence[RankKv],
        transport: Transport,
        bootstrap: str,
        settings: Settings | None = None,
        serve_bootstrap: bool = True,
        incarnation: str | None = None,
        executor: Executor | None = None,
        codec: WireCodec | None = None,
        planner_factory: type[TransferPlanner] = TransferPlanner,
        rng: random.Random | None = None,
        staging_slot_bytes: int = 0,
        staging_memory: EngineMemory | None = None,
        transfer_lanes: int = 4,
        started_at: float | None = None,
        is_mla: bool = False,
        placement: PrefillPlacement | None = None,
    ) -> None:
        if not ranks:
            raise ValueError("a prefill node needs at least one rank")
        if len({r.tp_rank for r in ranks}) != len(ranks):
            raise ValueError("each rank of a node needs its own tp_rank")
        self.settings = settings or load_settings()
        self.transport = transport
        self.bootstrap = bootstrap
        self.serve_bootstrap = serve_bootstrap
        self.is_mla = is_mla
        self.placement = placement or PrefillPlacement()
        """MLA KV (one latent head): registered, so a decode of the other kind is refused."""
        self.incarnation = incarnation or draw_incarnation()
        # Wall clock, not monotonic: it orders this life against a predecessor that may have
        # run on another host (the registry refuses the older one's registrations, 409).
        self.started_at = time.time() if started_at is None else started_at
        self.health = ""
        """``host:port`` of this process's own health endpoint (known once started)."""
        self.rank_kv = list(ranks)
        self.runtime = NodeRuntime("prefill", self.settings, self.incarnation,
                                   codec or MsgpackCodec())  # fmt: skip
        self._executor = executor
        self._planners = {r.tp_rank: planner_factory(r) for r in ranks}
        for planner in self._planners.values():
            planner.stage = self.placement.pp_size > 1
        if self.placement.pp_size > 1 and any(r.state for r in ranks):
            raise ValueError("model state with pipeline stages is not supported yet; run the "
                             "prefill with pp_size=1 or without state components")  # fmt: skip
        self._rng = rng or random.Random()
        self.source_ready: dict[tuple[int, int], SourceReady] = {}
        """(tp rank, room) -> the readiness the engine gave with the room's latest chunk."""
        self.limits = {
            r.tp_rank: PrefillRankLimits(self.settings.control_max_early_pages,
                                         self.settings.bootstrap_timeout,
                                         self.settings.control_max_early_pages_per_decode)
            for r in ranks
        }  # fmt: skip
        self._queues = TransferQueues(self.settings.transfer_queues, transfer_lanes)
        self._stack = AsyncExitStack()
        self.ranks: list[PrefillRank] = []
        self._hosts: list[EndpointHost] = []
        self._registered: list[tuple[int, int]] = []
        self.registration = RegistrationKeeper()
        """This node's hold on its standalone registry entry (re-registers after a restart)."""
        # One local staging slot per transfer worker (a queue's lane runs one write at a
        # time, so its slot is never shared), for heterogeneous TP and for small rooms: a
        # host-memory node that allocates its own slots makes each hold at least a small room
        # (a decode may stage any room up to SMALL_ROOM_STAGING_LIMIT).
        self._host_memory = in_host_memory(ranks)
        self.staging_slot_bytes = (
            max(staging_slot_bytes, SMALL_ROOM_STAGING_LIMIT)
            if staging_memory is None and self._host_memory
            else staging_slot_bytes
        )
        self._staging: ctypes.Array[ctypes.c_uint8] | None = None
        self.staging_memory = staging_memory
        """The engine's own staging memory (device memory, say); None: the node allocates it."""
        self.staging_base: int | None = None

    async def _start(self) -> None:
        settings = self.settings
        if self.serve_bootstrap:
            bind_host, _, port = self.bootstrap.rpartition(":")
            running = await self._stack.enter_async_context(serve(
                bind_host or settings.host, int(port), token=settings.bootstrap_token,
                incarnation=self.incarnation, dp_rank_ttl=settings.dp_rank_ttl,
                max_body=settings.bootstrap_max_body, wedged=self.wedged,
            ))  # fmt: skip
            self.bootstrap = running.address
            # The hosted registry runs in this process: its /health is this process's own.
            self.health = running.address
        else:
            self.health = await self._stack.enter_async_context(
                serve_health(settings.host, self.incarnation, wedged=self.wedged)
            )
        for rank_kv in self.rank_kv:
            self._add_rank(rank_kv, self.runtime.open_channel())
        for rank_kv in self.rank_kv:
            for addr, size in rank_kv.buffers():
                self.transport.register_buffer(addr, size)
                self._registered.append((addr, size))
        if self.staging_slot_bytes:
            size = self.staging_slot_bytes * self._queues.workers
            if self.staging_memory is None:
                self._staging = (ctypes.c_uint8 * size)()
                self.staging_base = ctypes.addressof(self._staging)
            else:
                self.staging_memory.check_holds(
                    size, "a staging slot per transfer worker (queues x lanes)"
                )
                self.staging_base = self.staging_memory.addr
            self.transport.register_buffer(self.staging_base, size)
            self._registered.append((self.staging_base, size))
        if (self.settings.checksum or self.staging_slot_bytes) and self._executor is None:
            self._executor = executor_for(self.rank_kv)
        self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
        self._queues.start(self._tasks)
        await self._serve_metrics()
        for host, channel in zip(self._hosts, self.runtime.channels, strict=True):
            self._tasks.start_soon(host.run_timer)
            self._tasks.start_soon(channel.receive_forever, self._deliverer(host, channel))
        await self._register_ranks()
        if not self.serve_bootstrap:
            self._tasks.start_soon(self._keep_registered)
        log.info("prefill_node_ready", node=self.runtime.node_id, bootstrap=self.bootstrap,
                 ranks=[h.me.address for h in self._hosts])  # fmt: skip

    def wedged(self) -> str | None:
        """Why this process's health endpoint answers 503 now (a wedged rank), or None."""
        return wedged_ranks(self._hosts, self.settings.control_stall_limit)

    def _add_rank(self, rank_kv: RankKv, channel: ControlChannel) -> None:
        parallel = Parallelism(tp=rank_kv.tp_size, cp=self.placement.cp_size,
                               pp=self.placement.pp_size, dp=self.placement.dp_size)  # fmt: skip
        unique = prefill_unique_rank(parallel, tp_rank=rank_kv.tp_rank,
                                     pp_rank=self.placement.pp_rank,
                                     cp_rank=self.placement.cp_rank)  # fmt: skip
        me = PeerId(channel.address, self.incarnation, unique)
        config = PrefillEndpointConfig(me=me, policy=self.settings.allocation_policy,
                                       timeouts=timeouts_from(self.settings),
                                       session_id=self.transport.session_id,
                                       max_decode_layouts=self.settings.control_max_peers,
                                       max_layout_bytes=self.settings.control_max_layout_bytes,
                                       )  # fmt: skip
        endpoint_id = self.runtime.endpoint_id(unique)
        endpoint = self.runtime.recorder.wrap(endpoint_id, PrefillEndpoint(config))
        host = EndpointHost(endpoint_id, endpoint, rank_kv.tp_rank, me, self._dispatcher,
                            self.runtime.metrics, self.runtime.events)  # fmt: skip
        self._hosts.append(host)
        self.ranks.append(PrefillRank(self, host))

    async def register_dp_rank(self, room: int) -> None:
        async with self._registry_client() as client:
            await client.register_dp_rank(room, self.placement.dp_rank)

    def _registry_client(self) -> BootstrapClient:
        return BootstrapClient(self.bootstrap, rng=self._rng, token=self.settings.bootstrap_token)

    async def _register_ranks(self) -> None:
        place = self.placement
        async with self._registry_client() as client:
            for rank_kv, host in zip(self.rank_kv, self._hosts, strict=True):
                ip, _, port = host.me.address.rpartition(":")
                await client.register_rank(RegisterRank(
                    attn_tp_size=rank_kv.tp_size, attn_tp_rank=rank_kv.tp_rank,
                    attn_cp_size=place.cp_size, attn_cp_rank=place.cp_rank,
                    attn_dp_size=place.dp_size, attn_dp_rank=place.dp_rank,
                    pp_size=place.pp_size, pp_rank=place.pp_rank,
                    system_dp_size=1, system_dp_rank=0,
                    load_balance_method=place.load_balance_method,
                    rank_ip=ip, rank_port=int(port), page_size=rank_kv.layout.page_size,
                    kv_cache_dtype=rank_kv.layout.dtype.value,
                    decode_allocation_policy=self.settings.allocation_policy,
                    incarnation=self.incarnation, protocol_version=PROTOCOL_VERSION,
                    started_at=self.started_at, checksum=self.settings.checksum,
                    is_mla=self.is_mla,
                    health=self.health, staging_slot_bytes=self.staging_slot_bytes,
                ))  # fmt: skip

    async def _keep_registered(self) -> None:
        """A standalone registry that restarted has forgotten this node: decodes get 503 until
        it registers again. Every heartbeat interval, ask the registry for each own rank and let
        the core's RegistrationKeeper decide; its RegisterAgain re-registers every rank with the
        same incarnation and started_at (the registry takes that as this same life)."""
        keeper = self.registration
        while True:
            await anyio.sleep(self.settings.heartbeat_interval)
            missing = await self._unregistered_ranks()
            if missing is None:
                continue  # unreachable: nothing learnt
            outputs, _ = keeper.fire(RanksProbed(missing), anyio.current_time())
            for output in outputs:
                assert isinstance(output, RegisterAgain)
                log.warning("registration_lost", node=self.runtime.node_id,
                            bootstrap=self.bootstrap, ranks=list(output.missing))  # fmt: skip
                try:
                    await self._register_ranks()
                except BootstrapError as exc:
                    answer = RegistrationAnswered(False, str(exc))
                    log.warning("reregistration_failed", node=self.runtime.node_id,
                                bootstrap=self.bootstrap, error=str(exc))  # fmt: skip
                else:
                    answer = RegistrationAnswered(True)
                    log.info("reregistered", node=self.runtime.node_id,
                             bootstrap=self.bootstrap, incarnation=self.incarnation)  # fmt: skip
                keeper.fire(answer, anyio.current_time())

    async def _unregistered_ranks(self) -> tuple[int, ...] | None:
        """The tp ranks of this node the registry does not hold; None when the registry could
        not be asked (unreachable tells nothing). A rank held by another incarnation is left
        to it (this life is superseded)."""
        place = self.placement
        missing = []
        async with self._registry_client() as client:
            for rank_kv in self.rank_kv:
                try:
                    held = await client.get_rank(place.dp_rank, place.cp_rank, rank_kv.tp_rank,
                                                 place.pp_rank)  # fmt: skip
                except RankNotFound:
                    missing.append(rank_kv.tp_rank)
                except BootstrapUnavailable as exc:
                    if exc.status != 503:  # unreachable
                        return None
                    missing.append(rank_kv.tp_rank)  # up, but collecting: some rank is missing
                except BootstrapError as exc:
                    log.warning("registration_probe_failed", node=self.runtime.node_id,
                                bootstrap=self.bootstrap, error=str(exc))  # fmt: skip
                    return None
                else:
                    if held.incarnation not in (None, self.incarnation):
                        log.warning("rank_held_by_other_incarnation", node=self.runtime.node_id,
                                    rank=rank_kv.tp_rank, incarnation=held.incarnation)  # fmt: skip
        return tuple(missing)

    async def _release(self) -> None:
        self._queues.close()
        for addr, _ in self._registered:
            try:
                self.transport.unregister_buffer(addr)
            except TransportError as exc:
                log.warning("unregister_failed", addr=hex(addr), error=str(exc))
        self._registered.clear()
        self.runtime.close()

    # ---- receiving -----------------------------------------------------------------------------
    def _deliverer(self, host: EndpointHost, channel: ControlChannel) -> Deliver:
        async def deliver(message: ControlMessage, msg_id: str | None) -> None:
            endpoint = host.endpoint
            refusal = self.limits[host.rank].refusal(
                message, endpoint.is_open, endpoint.layout_of, loop_time()
            )
            if refusal is None:
                await host.feed(Received(message, msg_id))
            else:
                self.runtime.metrics.frame_dropped(refusal)

        return deliver

    # ---- outputs -------------------------------------------------------------------------------
    def _dispatcher(self, host: EndpointHost) -> Dispatch:
        effects: PrefillEffects[Effect] = PrefillRankEffects(self, host)
        return partial(carry_out_prefill, effects)

    def rank_index(self, tp_rank: int) -> int:
        return [r.tp_rank for r in self.rank_kv].index(tp_rank)

    def channel_of(self, host: EndpointHost) -> ControlChannel:
        return self.runtime.channels[self._hosts.index(host)]

    def queue_transfer(self, key: str, job: Job) -> None:
        self._queues.submit(key, job)

    async def transfer(self, host: EndpointHost, start: StartTransfer, args: KvArgs | None,
                       worker: int) -> None:  # fmt: skip
        done = await self._write(host, start, args, worker)
        await host.feed(done)

    async def _write(
        self, host: EndpointHost, start: StartTransfer, args: KvArgs | None, worker: int
    ) -> TransferCompleted:
        if not self._write_wanted(host, start):
            return _failed(start, _NOT_SUBMITTED)
        if args is None:
            return _failed(
                start,
                f"decode {start.peer.address}#{start.peer.rank} never sent its KV "
                "layout (KvArgs precedes its first metadata); it may have restarted"
            )
        try:
            staged = self._staged_plan(host.rank, start, args, worker)
            ops = (
                self._planners[host.rank].plan(start, args) if staged is None else staged.write_ops
            )
            ops = (*ops, *self._state_plan(host.rank, start, args))
        except InvalidInput as exc:
            return _failed(start, f"cannot plan writes into {start.peer.address}: {exc}")
        try:
            checksum = await self._prepare_sources(host, start, args, staged)
        except Exception as exc:
            # The engine's readiness object, a gather or a digest failed: nothing was written
            # yet, so the chunk fails alone (raising would end every room of the node).
            log.warning("chunk_preparation_failed", room=start.room, seq=start.seq,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return _failed(start, f"reading the chunk's sources failed: "
                                  f"{type(exc).__name__}: {exc}")  # fmt: skip
        if not self._write_wanted(host, start):  # aborted during the gather or the digest
            return _failed(start, _NOT_SUBMITTED)
        try:
            outcome = await self.transport.batch_write(start.session_id, ops)
        except TransportError as exc:
            return _failed(start, f"transport refused the writes: {exc}")
        clock = host.clock_of(start.room, start.generation)
        if clock is not None:
            clock.add_transfer(outcome.seconds, outcome.nbytes)
        if not outcome.ok:
            return _failed(start, outcome.error or "transfer failed")
        aux = None
        if start.src_aux_index is not None:
            # Read after the KV writes: the engine filled the row before the last chunk.
            kv = self.rank_kv[self.rank_index(host.rank)]
            aux = read_aux_row(aux_buffer_of(kv, "the last chunk"), start.src_aux_index)
        return TransferCompleted(start.room, start.generation, start.seq, True, "", checksum, aux)

    async def _prepare_sources(self, host: EndpointHost, start: StartTransfer, args: KvArgs,
                               staged: StagedWrite | None) -> int | None:  # fmt: skip
        """Before the writes: wait for the chunk's readiness, gather a staged chunk, take the
        digest (returned, when checksums are on)."""
        ready = self.source_ready.get((host.rank, start.room))
        if ready is not None:
            await anyio.to_thread.run_sync(ready.synchronize)
        if staged is not None and staged.inline:
            copy_staged_host(staged.region, staged.pages, staged.slot, gather=True)
        elif staged is not None and self._executor is not None:
            await anyio.to_thread.run_sync(staged.gather, self._executor)
        if self.settings.checksum and self._executor is not None:
            return await anyio.to_thread.run_sync(self._digest, host.rank, start, args)
        return None

    @staticmethod
    def _write_wanted(host: EndpointHost, start: StartTransfer) -> bool:
        """Whether the chunk's room instance still transfers. A chunk of a room that failed or
        was aborted (DRAINING) while the chunk waited in its transfer queue is never handed to
        the transport: it cannot land, so the room's drain ACK waits only for writes already
        submitted, not for a queue of doomed ones ahead of it (chaos finding 8)."""
        summary = host.endpoint.summary(start.room)
        return (
            summary is not None
            and summary.generation == start.generation
            and summary.state == SenderState.TRANSFERRING.name
        )

    def _staged_plan(
        self, rank: int, start: StartTransfer, args: KvArgs, worker: int
    ) -> StagedWrite | None:
        """Gather-then-one-write when the decode placed a staging region for the room; the
        gather goes to the running worker's own slot."""
        if start.staging_offset is None:
            return None
        if self.staging_base is None or args.staging_addr is None:
            raise InvalidInput(
                "the decode placed a staging region for this chunk but "
                + ("this prefill has no staging slots" if self.staging_base is None
                   else "announced no staging ring")
            )  # fmt: skip
        region = self._planners[rank].region(args)
        if region is None:
            raise InvalidInput(f"rank {rank} shares no heads with {start.peer.address}")
        nbytes = len(start.src_pages) * region.page_bytes
        if nbytes > self.staging_slot_bytes:
            raise InvalidInput(
                f"a chunk of {len(start.src_pages)} pages needs {nbytes} staging bytes but the "
                f"slot holds {self.staging_slot_bytes}; raise staging_slot_bytes or send "
                "smaller chunks"
            )
        slot = self.staging_base + worker * self.staging_slot_bytes
        if not start.src_pages:
            return StagedWrite(region, (), slot, (), True)
        dst = (args.staging_addr + start.staging_offset
               + region.chunk_offset(start.room_pages, start.page_start))  # fmt: skip
        inline = self._host_memory and nbytes <= SMALL_ROOM_STAGING_LIMIT
        return StagedWrite(region, tuple(start.src_pages), slot, (WriteOp(slot, dst, nbytes),),
                           inline)  # fmt: skip

    def _state_plan(self, rank: int, start: StartTransfer, args: KvArgs) -> tuple[WriteOp, ...]:
        """The last chunk's model-state writes, split by the TP rule as KV is."""
        local = self._planners[rank].local
        return plan_state(local.state, args.state, start.src_state, start.dst_state, local.tp,
                          peer_place(args))  # fmt: skip

    def _digest(self, rank: int, start: StartTransfer, args: KvArgs) -> int:
        local = self._planners[rank].local
        if self._executor is None:
            return 0
        slices = exchanged_slices(local.kv_buffers, True, local.tp, peer_place(args), args.layout,
                                  self.placement.pp_size > 1)  # fmt: skip
        kv = kv_digest(self._executor, slices, start.src_pages, start.dst_pages,
                       args.layout.num_pages)  # fmt: skip
        state = 0
        if start.src_state:
            cuts = state_slices(local.state, True, local.tp, peer_place(args), args.state)
            state = state_digest(self._executor, cuts, start.src_state, start.dst_state)
        return (kv + state) % ROOM_FOLD_MODULUS


def _failed(start: StartTransfer, reason: str) -> TransferCompleted:
    return TransferCompleted(start.room, start.generation, start.seq, False, reason)
