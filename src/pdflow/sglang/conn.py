"""SGLang's transfer-backend contract (``disaggregation/base/conn.py``) on pdflow's nodes.

One SGLang scheduler process hosts one KV manager per role; here that manager runs one pdflow
node (a :class:`~pdflow.io.node_prefill.PrefillNode` or
:class:`~pdflow.io.node_decode.DecodeNode` with this process's one rank) on a
:class:`~pdflow.sglang.loop.LoopThread`. Senders and receivers turn the scheduler's calls into
queued node calls (they return at once) and answer ``poll()`` from the :class:`RoomBook` that
the node's events keep current. What the protocol decides (timeouts, heartbeats, fencing,
drains) pdflow decides; the adapter only translates.

Two guarantees SGLang's own backends do not give, and how they are kept:

* The prefill reports ``Failed`` only once pdflow removed the room, which it does only after
  every write already started has completed (the adapter clears a failed room at once, and the
  node forgets it when drained). Until then ``poll()`` repeats the last non-failed status.
* The decode releases a failed room's pages only after pdflow's ``PagesReleased``:
  :meth:`PdflowKVManager.is_abort_release_safe` is true only then, and the plugin's hook on
  ``DecodeTransferQueue._defer_release`` gives pdflow rooms no release-anyway deadline (see
  :mod:`pdflow.sglang.plugin`).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import anyio
import structlog
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving
from sglang.srt.utils.network import get_local_ip_auto

from pdflow.core.cluster.registry import PrefillServerInfo
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.io.bootstrap_client import BootstrapClient, BootstrapError
from pdflow.io.bootstrap_server import serve
from pdflow.io.node_common import NodeEvent, RoomStatus
from pdflow.io.node_decode import DecodeNode, DecodeRank
from pdflow.io.node_prefill import PrefillNode, PrefillRank
from pdflow.io.settings import Settings, load_settings, pdflow_variable
from pdflow.sglang.identity import instance_identity
from pdflow.sglang.layout import (
    UnsupportedByPdflow,
    rank_kv_from_kv_args,
    state_cross_tp_refusal,
    state_indices_for_pdflow,
)
from pdflow.sglang.loop import LoopThread
from pdflow.sglang.parallel import attention_tp, prefill_placement, refuse_unmapped_parallelism
from pdflow.sglang.rooms import NOTHING_KNOWN, RoomBook, RoomFacts
from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport

log = structlog.get_logger("pdflow.sglang")

SMALL_ROOM_STAGING_BYTES = 16 * 1024
"""The backend stages rooms up to this size (one bulk write instead of one per layer's K and V:
the engine's per-write cost dominates them); PDFLOW_SMALL_ROOM_STAGING_BYTES overrides it."""
# SGLang gives both roles the room id alone: every room is generation 0, and a request whose
# id the rank still holds is refused (RoomBook.claim).
GENERATION = 0
# How long the decode scheduler may wait for a prefill's topology on its first request there
# (a registry answers in milliseconds; an unreachable one costs at most this per retry).
TOPOLOGY_FIRST_WAIT_S = 0.25


def _routable(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _bootstrap_of_this_instance() -> str:
    """Where this prefill's ranks register: SGLang's own rule (dist_init_addr when multi-node)."""
    dist_init_addr = get_parallel().dist_init_addr
    host = dist_init_addr.rsplit(":", 1)[0] if dist_init_addr else get_serving().host
    return f"{_routable(host)}:{get_disagg().disaggregation_bootstrap_port}"


# ---- manager -----------------------------------------------------------------------------------
class PdflowKVManager(BaseKVManager):
    """One pdflow node for this scheduler process (prefill or decode), on its own loop thread."""

    enable_deferred_decode_kv_release = True
    supports_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False
    is_dummy_cp_rank = False
    enable_all_cp_ranks_for_transfer = False
    attn_cp_size = 1
    attn_cp_rank = 0

    def __init__(self, args: Any, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:  # fmt: skip
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        parallel = get_parallel()
        if (disaggregation_mode == DisaggregationMode.DECODE
                and not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()):
            raise UnsupportedByPdflow(
                "pdflow's SGLang backend needs SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE "
                "on (the default): without it SGLang frees a failed room's pages while the "
                "prefill may still write them"
            )
        refuse_unmapped_parallelism(parallel)
        tp_size, tp_rank = attention_tp(parallel)
        self.rank_kv = rank_kv_from_kv_args(args, tp_size=tp_size, tp_rank=tp_rank,
                                            is_mla=self.is_mla_backend)  # fmt: skip
        # Why this rank's model state cannot go to another TP width ('' when it can).
        self.state_cross_tp_refusal = state_cross_tp_refusal(args, tp_size)
        self.placement = prefill_placement(
            parallel, getattr(args, "system_dp_rank", None),
            force_query_dp_rank=bool(envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get()),
        )  # fmt: skip
        self.local_ip = get_local_ip_auto()
        # SGLang's --disaggregation-decode-allocation-policy governs both roles' schedulers, so
        # it governs pdflow's nodes too (early, or prefill_complete: the decode reserves pages
        # only once the prefill's forward pass ended, mark_prefill_complete).
        policy = AllocationPolicy(get_disagg().disaggregation_decode_allocation_policy)
        self.settings: Settings = load_settings(
            host=self.local_ip, allocation_policy=policy,
            small_room_staging_bytes=_small_room_staging_default(),
        )  # fmt: skip
        self.book = RoomBook()
        # Decode: prefill topologies by bootstrap address, as SGLang's decode queue reads them.
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self._topology_pending: set[str] = set()
        # Decode: SGLang's prealloc queue runs its /query_dp_ranks lookups on this executor
        # (prefetch_prefill_dp_rank_queries), one per manager as on its own backends.
        self._dp_rank_query_executor: ThreadPoolExecutor | None = None
        self.transfer_infos: dict[int, Any] = {}
        self.loop = LoopThread(f"pdflow-{disaggregation_mode.value}-{args.engine_rank}")
        self.transport = MooncakeTransport.open(MooncakeConfig(
            host=self.local_ip, protocol=self.settings.transport_protocol,
            device_name=getattr(args, "ib_device", None) or "",
        ))  # fmt: skip
        self.node: PrefillNode | DecodeNode = self._build_node()
        self._node_cm = self.loop.portal.wrap_async_context_manager(self.node)
        self._node_cm.__enter__()
        self.loop.portal.call(self._watch_events)
        log.info("pdflow_sglang_manager_ready", mode=disaggregation_mode.value,
                 rank=self.rank_kv.tp_rank, node=self.node.runtime.node_id)  # fmt: skip

    def _build_node(self) -> PrefillNode | DecodeNode:
        incarnation, started_at = instance_identity()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            return PrefillNode(
                ranks=[self.rank_kv], transport=self.transport,
                bootstrap=_bootstrap_of_this_instance(), settings=self.settings,
                serve_bootstrap=False, incarnation=incarnation, started_at=started_at,
                placement=self.placement,
            )  # fmt: skip
        # A decode rank is its own peer: its incarnation only has to be new per process.
        return DecodeNode(ranks=[self.rank_kv], transport=self.transport, settings=self.settings,
                          is_mla=self.is_mla_backend)  # fmt: skip

    async def _watch_events(self) -> None:
        """Record every node event in the RoomBook as it is published (on the loop, inside
        the step: no reader task, no stream hand-over per event)."""
        prefill = self.prefill_rank if isinstance(self.node, PrefillNode) else None
        book = self.book

        def record(event: NodeEvent) -> None:
            if (prefill is not None and isinstance(event, RoomStatus)
                    and event.poll is KVPoll.Success):  # fmt: skip
                nbytes, seconds = prefill.transfer_stats(event.room)
                book.record_transfer(event.room, nbytes, seconds)
            book.apply(event)

        self.node.watch(record)

    @property
    def prefill_rank(self) -> PrefillRank:
        assert isinstance(self.node, PrefillNode)
        return self.node.ranks[0]

    @property
    def decode_rank(self) -> DecodeRank:
        assert isinstance(self.node, DecodeNode)
        return self.node.ranks[0]

    def run(self, room: int, name: str, call: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Queue the node call ``call(*args)`` (``name`` in its refusal) for ``room``; a
        refusal fails the room with the core's reason. No closure per call: the arguments and
        the refusal's context travel in the queue."""
        self.loop.submit(call, partial(self._refused, room, name), *args)

    def _refused(self, room: int, name: str, exc: BaseException) -> None:
        reason = f"pdflow refused {name}: {exc}"
        log.warning("pdflow_call_refused", room=room, error=reason)
        # A refused publish_pages left the pages with SGLang: no writer was told of them.
        self.book.refuse(room, reason, pages_taken=name != "publish_pages")

    # ---- SGLang's manager contract -------------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """The prefill node registers its rank when it starts (in ``__init__``)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: True once the prefill's topology is known; else starts a fetch and waits for
        it at most ``TOPOLOGY_FIRST_WAIT_S``. SGLang's prealloc queue asks again only after its
        retry interval (1 s), so answering False at once would hold every first request to a
        prefill for that second; SGLang's own backends block on the fetch (up to 5 s)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        if bootstrap_addr not in self._topology_pending:
            self._topology_pending.add(bootstrap_addr)
            fetched = threading.Event()

            async def fetch_topology() -> None:
                try:
                    await self._fetch_topology(bootstrap_addr)
                finally:
                    fetched.set()

            self.loop.spawn(fetch_topology, lambda exc: log.warning(
                "prefill_topology_fetch_failed", bootstrap=bootstrap_addr, error=str(exc)))
            fetched.wait(TOPOLOGY_FIRST_WAIT_S)
        return bootstrap_addr in self.prefill_info_table

    async def _fetch_topology(self, bootstrap_addr: str) -> None:
        try:
            async with BootstrapClient(bootstrap_addr, rng=random.Random(),
                                       token=self.settings.bootstrap_token) as client:  # fmt: skip
                info = await client.get_topology(deadline_s=5.0)
            self.prefill_info_table[bootstrap_addr] = info
        except (BootstrapError, OSError) as exc:
            log.info("prefill_topology_unavailable", bootstrap=bootstrap_addr, error=str(exc))
        finally:
            self._topology_pending.discard(bootstrap_addr)

    def _ensure_prefill_recompute_executor(self) -> ThreadPoolExecutor:
        """The executor SGLang's decode queue submits its batched ``/query_dp_ranks`` lookups
        to (its name is SGLang's; pdflow runs no prefill recompute on it)."""
        if self._dp_rank_query_executor is None:
            self._dp_rank_query_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="pdflow-dp-rank-query")
        return self._dp_rank_query_executor

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """True once no write can land in the room's pages (:meth:`RoomBook.release_safe`):
        pdflow released them, the room succeeded, or pdflow never had them. ``required_acks``
        (SGLang's ACK count) is not needed: pdflow tracks the writers."""
        return self.book.release_safe(bootstrap_room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing to drop here: SGLang calls the receiver's ``clear`` next, which finishes
        the room in the book (by room id alone this could be another request's entry)."""

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang's KV digest (taken by the prefill, moved in the aux row) covers what this
        rank received only when the prefill has this rank's TP width: each rank then gets its
        peer's whole pages. With other widths a rank gets head slices of several digests."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is not None and int(info.attn_tp_size) == self.rank_kv.tp_size

    def register_buffer_to_engine(self) -> None:
        raise UnsupportedByPdflow("pdflow's SGLang backend cannot re-register KV memory "
                                  "(release/resume_memory_occupation) yet")  # fmt: skip

    deregister_buffer_to_engine = register_buffer_to_engine

    def close(self) -> None:
        """Stop the node (deregisters its buffers) and the loop."""
        if self._dp_rank_query_executor is not None:
            self._dp_rank_query_executor.shutdown(wait=False, cancel_futures=True)
        try:
            self._node_cm.__exit__(None, None, None)
        finally:
            self.loop.close()


async def _abort_if_live(rank: PrefillRank | DecodeRank, room: int) -> None:
    if rank.poll(room) not in (None, KVPoll.Failed, KVPoll.Success):
        await rank.abort(room, "aborted by SGLang")


async def _clear_if_open(rank: PrefillRank | DecodeRank, room: int,
                         if_unknown: Callable[[int], None] | None) -> None:  # fmt: skip
    if rank.poll(room) is not None:
        await rank.clear(room)
    elif if_unknown is not None:
        if_unknown(room)


async def _send_chunk_when_copied(rank: PrefillRank, room: int, kv_indices: Sequence[int],
                                  is_last: bool, state: tuple[tuple[int, ...], ...],
                                  indices_event: Any) -> None:  # fmt: skip
    """The chunk's page ids are read once SGLang's device-to-host copy completed (its CUDA
    event, waited in a worker thread); the event is also the chunk's ``ready``."""
    await anyio.to_thread.run_sync(indices_event.synchronize)
    await rank.send_chunk(room, [int(page) for page in kv_indices], is_last, state,
                          ready=indices_event)  # fmt: skip


async def _publish_pages(rank: DecodeRank, room: int, pages: list[int], aux_index: int | None,
                         prefix: int, state: tuple[tuple[int, ...], ...]) -> None:  # fmt: skip
    await rank.publish_pages(room, pages, aux_index=aux_index, decode_prefix_len=prefix,
                             state_indices=state)  # fmt: skip


def _terminal_reason(facts: RoomFacts, room: int, what: str) -> str:
    return facts.local_error or facts.reason or f"pdflow reported the {what} of room {room} failed"


def _duplicate_book(room: int) -> RoomBook:
    """A book of one room, already failed and closed, for a request whose room id an earlier
    request on this rank still holds in pdflow: it touches neither pdflow nor that request."""
    book = RoomBook()
    book.claim(room)
    book.refuse(room, f"room id {room} is still in use by an earlier request on this rank "
                "(pdflow has not finished with it); the router must give every request its "
                "own bootstrap_room")  # fmt: skip
    book.close(room)
    return book


class _RequestRoom:
    """What a sender and a receiver share: the room id they claimed in the manager's book, and
    the node calls made for it."""

    kv_mgr: PdflowKVManager
    bootstrap_room: int

    def _claim(self) -> None:
        room = self.bootstrap_room
        claimed = self.kv_mgr.book.claim(room)
        self._book = self.kv_mgr.book if claimed else _duplicate_book(room)
        if not claimed:
            log.warning("pdflow_room_id_in_use", room=room)
        self._facts_of = self._book.reader()

    @property
    def _claimed(self) -> bool:
        """False for a request refused because its room id was in use: pdflow's room of that
        id is the earlier request's, and nothing of this one goes to pdflow."""
        return self._book is self.kv_mgr.book

    def _call(self, name: str, call: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Queue a node call for this request's room (none for an unclaimed one)."""
        if self._claimed:
            self.kv_mgr.run(self.bootstrap_room, name, call, *args)

    def _queue_abort(self, rank: PrefillRank | DecodeRank) -> None:
        """Abort the room in pdflow unless it already ended (pdflow then drains or fences)."""
        self._call("abort", _abort_if_live, rank, self.bootstrap_room)

    def _queue_clear(self, rank: PrefillRank | DecodeRank) -> None:
        """Clear the room in pdflow if pdflow still has it; one it never opened (refused) has
        nothing in flight and is closed at once."""
        self._call("clear", _clear_if_open, rank, self.bootstrap_room, self._book.close)


# ---- prefill -----------------------------------------------------------------------------------
class PdflowKVSender(_RequestRoom, BaseKVSender):
    """One request on one prefill rank: chunks in, ``poll()`` out."""

    @property
    def supports_host_tensor_indices(self) -> bool:
        """Whether SGLang may hand send() page ids still being copied from the GPU, with the
        CUDA event that ends the copy (``indices_event``): pdflow reads them after it, off
        the scheduler. Only with CUDA (SGLang's copy needs pinned memory and CUDA events;
        its mooncake backend says yes unconditionally)."""
        return bool(torch.cuda.is_available())

    def __init__(self, mgr: PdflowKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:  # fmt: skip
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.num_pages = 0
        self.pages_sent = 0
        self.aux_index: int | None = None
        self.init_time: float | None = None
        self._last_live = KVPoll.Bootstrapping
        # The last facts poll() answered from while not failed, and that answer: facts are
        # immutable snapshots, so the same object gives the same answer (the scheduler polls
        # every room on every tick, far more often than its facts change).
        self._answered_facts: RoomFacts | None = None
        self._answer = int(KVPoll.Bootstrapping)
        self._cleared = False
        self._aborted = False
        # The room's facts once SGLang is done with it and the book may forget it: what SGLang
        # may still read (the transfer metric after clear, the reason after Failed), and what
        # poll() answers from once the entry is gone.
        self._final_facts: RoomFacts | None = None
        self.conclude_state: int | None = None
        self._claim()
        self._call("open_room", mgr.prefill_rank.open_room, self.bootstrap_room, GENERATION)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        rank, room = self.kv_mgr.prefill_rank, self.bootstrap_room
        self.num_pages, self.aux_index, self.init_time = int(num_kv_indices), aux_index, time.time()
        self._call("init_transfer", rank.init_transfer, room, self.num_pages, self.aux_index)

    def send(self, kv_indices: Sequence[int], state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None, indices_event: Any = None,
             **_: Any) -> None:  # fmt: skip
        """``indices_event`` (SGLang, as this sender ``supports_host_tensor_indices``): the
        CUDA event after the asynchronous device-to-host copy of ``kv_indices`` (a pinned CPU
        tensor), recorded after the forward pass that wrote the chunk. The page ids are read
        only once it completed, on pdflow's loop (waited in a worker thread), so the
        scheduler never waits for the copy; it is also the chunk's ``ready``."""
        rank, room = self.kv_mgr.prefill_rank, self.bootstrap_room
        try:  # SGLang names the request's state on the last chunk only
            state = state_indices_for_pdflow(state_indices, len(self.kv_mgr.rank_kv.state))
        except UnsupportedByPdflow as exc:
            self._book.refuse(room, str(exc))
            return
        self.pages_sent += len(kv_indices)  # a tensor's length needs no copy
        is_last = self.pages_sent >= self.num_pages
        if indices_event is None:
            pages = [int(page) for page in kv_indices]
            self._call("send_chunk", rank.send_chunk, room, pages, is_last, state)
        else:
            self._call("send_chunk", _send_chunk_when_copied, rank, room, kv_indices, is_last,
                       state, indices_event)  # fmt: skip

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # A zero-page last chunk still ends the room (a fully cached prompt).
        return num_pages > 0 or last_chunk

    def mark_prefill_complete(self) -> None:
        """prefill_complete policy: the forward pass ended; pdflow tells the decode it may
        reserve the room's pages now (and starts the room's bootstrap clock)."""
        rank, room = self.kv_mgr.prefill_rank, self.bootstrap_room
        self._call("prefill_completed", rank.prefill_completed, room)

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode already holds (its ``decode_prefix_len``), known once the room is
        WaitingForInput, when SGLang asks: it then sends only the pages after them."""
        return self.kv_mgr.prefill_rank.decode_prefix_len(self.bootstrap_room)

    def get_max_transfer_tokens(self) -> int | None:
        return None

    def poll(self) -> int:
        facts = self._facts_of(self.bootstrap_room, self._final_facts or NOTHING_KNOWN)
        if facts is self._answered_facts:
            return self._answer
        failed = bool(facts.local_error) or facts.poll is KVPoll.Failed
        if not failed:
            if facts.poll is not None:
                self._last_live = facts.poll
            self._answered_facts, self._answer = facts, int(self._last_live)
            return self._answer
        # Failed, but writes may still be landing: clear now, report once pdflow forgot the room
        # (it does only when every started write completed).
        if facts.local_error and facts.poll is not KVPoll.Failed and not self._aborted:
            self.abort()
        self._clear_in_pdflow()
        if not facts.closed:
            return int(self._last_live)
        self.conclude_state = KVPoll.Failed
        self._finish(facts)  # SGLang's last answer: only failure_exception reads on
        return int(KVPoll.Failed)

    def failure_exception(self) -> None:
        """SGLang concludes the room failed on this rank (``handle_inflight_transfer_failure``)
        and frees it. With TP > 1 that may be another rank's failure (SGLang takes the lowest
        poll over the ranks) while this rank's room is still live in pdflow: it is aborted and
        cleared here, or it would stay in pdflow and in the book, never polled again."""
        facts = self._final_facts or self._book.facts(self.bootstrap_room)
        if self._final_facts is None and not self._aborted:
            self.abort()
        raise KVTransferError(self.bootstrap_room,
                              _terminal_reason(facts, self.bootstrap_room, "transfer"))

    def get_transfer_metric(self) -> KVTransferMetric:
        facts = self._final_facts or self._book.facts(self.bootstrap_room)
        return KVTransferMetric(transfer_latency_s=facts.transfer_s,
                                transfer_total_bytes=facts.bytes_moved)  # fmt: skip

    def abort(self) -> None:
        """Abort and clear at once: SGLang may drop the request without polling it again
        (``release_aborted_prefill_waiting_req``), and pdflow still drains the room's
        writes before it forgets it. A later poll() reports Failed once pdflow closed it."""
        self._aborted = True
        facts = self._book.facts(self.bootstrap_room)
        self._queue_abort(self.kv_mgr.prefill_rank)
        self._clear_in_pdflow()
        # Once pdflow closed it the book forgets it: a later poll() reads a closed failure.
        self._finish(RoomFacts(poll=KVPoll.Failed, closed=True,
                               reason=facts.reason or "aborted by SGLang",
                               local_error=facts.local_error))  # fmt: skip

    def clear(self) -> None:
        """SGLang's end of a successful room (it reads the transfer metric after this)."""
        self._clear_in_pdflow()
        self._finish(self._book.facts(self.bootstrap_room))

    def _finish(self, facts: RoomFacts) -> None:
        if self._final_facts is None:
            self._final_facts = facts
        self._book.finish(self.bootstrap_room)

    def _clear_in_pdflow(self) -> None:
        if self._cleared:
            return
        self._cleared = True
        self._queue_clear(self.kv_mgr.prefill_rank)


# ---- decode ------------------------------------------------------------------------------------
class PdflowKVReceiver(_RequestRoom, BaseKVReceiver):
    """One request on one decode rank: open, publish its pages, ``poll()`` until it lands."""

    require_staging = False

    def __init__(self, mgr: PdflowKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:  # fmt: skip
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.bootstrap_infos: list[str] | None = None
        self.abort_notified = False
        self.conclude_state: int | None = None
        self.init_time: float | None = None
        self._opened = False
        self._cleared = False
        # As on the sender: the last facts poll() answered from, and that answer.
        self._answered_facts: RoomFacts | None = None
        self._answer = int(KVPoll.Bootstrapping)
        self._claim()

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int) -> None:
        rank, room, addr = self.kv_mgr.decode_rank, self.bootstrap_room, self.bootstrap_addr
        self.bootstrap_infos = [addr]  # one prefill instance: what a release waits on
        self._opened = True
        self._call("open_room", rank.open, room, GENERATION, addr, prefill_dp_rank)

    def send_metadata(self, kv_indices: Sequence[int], aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None,
                      destination: Any = KVTransferDestination.DEVICE) -> None:  # fmt: skip
        room = self.bootstrap_room
        problem = ""
        state: tuple[tuple[int, ...], ...] = ()
        if destination != KVTransferDestination.DEVICE:
            problem = "pdflow does not receive into host destinations yet"
        else:
            try:
                state = state_indices_for_pdflow(state_indices, len(self.kv_mgr.rank_kv.state))
            except UnsupportedByPdflow as exc:
                problem = str(exc)
            info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr) if state else None
            if (info is not None and int(info.attn_tp_size) != self.kv_mgr.rank_kv.tp_size
                    and self.kv_mgr.state_cross_tp_refusal):
                problem = (f"{self.kv_mgr.state_cross_tp_refusal} (prefill attention TP "
                           f"{info.attn_tp_size}, this decode {self.kv_mgr.rank_kv.tp_size})")
        if problem:
            self._book.refuse(room, problem)
        if problem or not self._claimed:
            return
        pages = [int(page) for page in kv_indices]
        self.init_time = time.time()
        rank = self.kv_mgr.decode_rank
        self._book.give_pages(room)  # before the call: a refusal takes it back

        prefix = int(decode_prefix_len or 0)
        # ``pages`` are those after the prefix the decode already holds, as SGLang gives them.
        self._call("publish_pages", _publish_pages, rank, room, pages, aux_index, prefix, state)

    def poll(self) -> int:
        facts = self._facts_of(self.bootstrap_room, NOTHING_KNOWN)
        if facts is self._answered_facts:
            return self._answer
        if facts.local_error:
            self.conclude_state = KVPoll.Failed
            answer = int(KVPoll.Failed)
        elif facts.poll is None:
            answer = int(KVPoll.Bootstrapping)
        else:
            if facts.poll.is_terminal:
                self.conclude_state = facts.poll
            answer = int(facts.poll)
        self._answered_facts, self._answer = facts, answer
        return answer

    def failure_exception(self) -> None:
        facts = self._book.facts(self.bootstrap_room)
        raise KVTransferError(self.bootstrap_room,
                              _terminal_reason(facts, self.bootstrap_room, "receive"))

    def abort(self) -> None:
        self.conclude_state = KVPoll.Failed
        if not self._book.facts(self.bootstrap_room).local_error:
            self._book.refuse(self.bootstrap_room, "aborted by SGLang")
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell pdflow once; pdflow keeps the pages quarantined until every writer drained.
        A request refused for a room id in use tells nothing, so SGLang holds nothing: its
        pages never reached pdflow."""
        if self.abort_notified or not self._claimed:
            return
        self.abort_notified = True
        if self._opened:
            self._queue_abort(self.kv_mgr.decode_rank)

    def is_abort_release_safe(self) -> bool:
        return self._book.release_safe(self.bootstrap_room)

    def clear(self) -> None:
        """SGLang is done with the request: pdflow clears the room, and the book forgets it
        once pdflow closed it (at once for a room pdflow never opened)."""
        if self._cleared:
            return
        self._cleared = True
        self._book.finish(self.bootstrap_room)
        if self._opened:
            self._queue_clear(self.kv_mgr.decode_rank)
        else:
            self._book.close(self.bootstrap_room)


# ---- bootstrap server --------------------------------------------------------------------------
class PdflowKVBootstrapServer(BaseKVBootstrapServer):
    """pdflow's registry (SGLang's routes: /route, /register_dp_rank, /query_dp_ranks,
    /health) in its own loop thread, serving this instance's incarnation on /health."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, int(port)
        incarnation, _ = instance_identity()
        settings = load_settings()
        self.loop = LoopThread("pdflow-bootstrap")
        self._server_cm = self.loop.portal.wrap_async_context_manager(serve(
            host or "0.0.0.0", self.port, token=settings.bootstrap_token,
            incarnation=incarnation, dp_rank_ttl=settings.dp_rank_ttl,
            max_body=settings.bootstrap_max_body,
        ))  # fmt: skip
        self.running = self._server_cm.__enter__()
        log.info("pdflow_sglang_bootstrap_ready", address=self.running.address)

    def close(self) -> None:
        try:
            self._server_cm.__exit__(None, None, None)
        finally:
            self.loop.close()


def _small_room_staging_default() -> int | None:
    """The backend's small-room staging, unless the deployment set the variable itself."""
    if os.environ.get(pdflow_variable("small_room_staging_bytes")):
        return None
    return SMALL_ROOM_STAGING_BYTES
