"""A stand-in SGLang scheduler: drives a transfer backend exactly as SGLang 0.5.23's queues do.

It builds the backend's classes through SGLang's own ``get_kv_class`` (after ``load_plugins``,
as every SGLang process does), with SGLang's ``KVArgs``, ``MetadataBuffers`` and
``poll_and_all_reduce`` (gloo group of one), over Mooncake TCP on loopback, and calls them in
the queues' order:

* prefill (``PrefillBootstrapQueue`` then the inflight queue): sender per request ->
  ``poll()`` each tick until WaitingForInput -> ``init(num_pages, aux_index)`` ->
  ``send(page_chunk)`` per chunk (``should_send_kv_chunk`` first; the last chunk is the one that
  reaches ``num_pages``) -> ``poll()`` until Success (``clear()`` then
  ``get_transfer_metric()``) or Failed (``failure_exception()``).
* decode (``DecodePreallocQueue`` then ``DecodeTransferQueue``): receiver per request ->
  ``try_ensure_parallel_info(addr)`` until true -> ``init(dp_rank)`` -> ``poll()`` until
  WaitingForInput -> pages from the free list -> ``send_metadata(pages, aux_index, None)`` ->
  ``poll()`` until Success (bytes checked, ``clear()``, pages back) or Failed
  (``failure_exception()``, ``ensure_abort_notified(force_arm=True)``, then SGLang's own
  ``DecodeTransferQueue._defer_release`` / ``resolve_deferred_releases`` / ``_do_release``
  decide when the pages come back).

The transfer queue polls through SGLang's own metadata gate (``poll_and_all_reduce`` with
the decode requests and ``MetadataBuffers``: Success is held while the room's aux row has not
landed), and each landed aux row is checked: the prefill writes it as ``MetadataBuffers.set_buf``
does (first output token, the room id) before the last chunk.

Run as ``python tests_sglang/driver.py prefill|decode ...``; it writes one JSON line per event
(to ``--events-fd``, else stdout). The decode reads JSON commands on stdin (``batch``,
``abort``, ``report``, ``quit``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PDFLOW_TRACE", "0")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

MODEL_DIR = Path(__file__).resolve().parent / "model"
TICK_S = 0.001  # one scheduler iteration when nothing happened


# Events go to their own file descriptor (--events-fd), one JSON object per line: logs from the
# node's threads share stdout and would split lines.
_events = sys.stdout


def emit(kind: str, **fields: Any) -> None:
    _events.write(json.dumps({"event": kind, **fields}) + "\n")
    _events.flush()


def first_token(room: int) -> int:
    """The first output token the prefill puts in a room's aux row."""
    return 1000 + room % 1000


def kv_digest(room: int) -> int:
    """The KV digest the prefill writes into a room's aux row (``--kv-checksum``), as
    ``MetadataBuffers.set_kv_checksum`` does after SGLang's ``KvChecksumComputer`` ran."""
    return 0x5EED0000 + room


CHECKSUM_SIGNATURE = 0x1A70  # the layout signature that digest was taken under


def expected(room_index: int, pos: int, layer: int, kv: int) -> float:
    """What every element of page ``pos`` of room ``room_index`` holds (exact in float32)."""
    return float(((room_index % 2048) * 64 + pos % 64) * 64 + layer * 2 + kv)


# ---- SGLang plumbing ---------------------------------------------------------------------------
def start_sglang(mode: str, args: argparse.Namespace) -> Any:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # what every SGLang process does first: registers pdflow's backend
    server_args = ServerArgs(
        model_path=str(MODEL_DIR), skip_tokenizer_init=True, device="cpu", host="127.0.0.1",
        port=args.http_port, page_size=args.page_size, disaggregation_mode=mode,
        disaggregation_transfer_backend=args.backend,
        disaggregation_bootstrap_port=args.bootstrap_port,
        disaggregation_decode_allocation_policy=args.allocation_policy,
        # Attention DP: SGLang's TP ranks are DP groups x attention TP ranks (tp-size here).
        tp_size=args.tp_size * args.dp_size, dp_size=args.dp_size,
        enable_dp_attention=args.dp_size > 1,
        **({"load_balance_method": args.load_balance_method} if args.load_balance_method
           else {}),
    )  # fmt: skip
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=global_tp_rank(args)))
    get_parallel().override_permanently(pp_group=None)
    if not dist.is_initialized():
        # The attention TP group's gloo group, as a scheduler has: SGLang's poll reductions
        # (MIN over the ranks) run unchanged. A TP=1 process (one per DP group with attention
        # DP and attention TP 1) has a group of one.
        store = args.gloo_store or str(
            Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-driver-gloo-{os.getpid()}")
        if args.tp_size == 1:
            Path(store).unlink(missing_ok=True)
        dist.init_process_group("gloo", init_method=f"file://{store}",
                                world_size=args.tp_size, rank=args.tp_rank)  # fmt: skip
    return server_args


# The Mamba pool: (channels or heads over all attention TP ranks, floats each) of the conv and
# the SSM buffer; at TP 1 a slot is 4 x 3 + 2 x 10 = 32 floats.
MAMBA_SPLIT = ((4, 3), (2, 10))


def global_tp_rank(args: argparse.Namespace) -> int:
    """SGLang's TP rank of this process: (DP group, attention TP rank), TP fastest."""
    return args.dp_rank * args.tp_size + args.tp_rank


def serving_dp_rank(room: int, args: argparse.Namespace) -> int:
    """The prefill DP group the router sends ``room`` to: room % dp_size under SGLang's
    follow_bootstrap_room; under another load-balancing method, a group the decode cannot
    compute from the room (the next one), so it has to ask the registry (/query_dp_ranks)."""
    follows = args.load_balance_method in (None, "follow_bootstrap_room")
    return (room if follows else room + 1) % args.dp_size


class CpuKv:
    """An SGLang-shaped MHA pool: one tensor per layer for K, then V; page 0 is padding."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        # This rank's heads of the model's KV heads (TP splits them).
        shape = (args.pool_pages + 1, args.page_size, args.heads // args.tp_size, args.head_dim)
        self.layers = args.num_layers
        self.k = [torch.zeros(shape, dtype=torch.float32) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.float32) for _ in range(args.num_layers)]
        buffers = self.k + self.v
        self.ptrs = [b.data_ptr() for b in buffers]
        self.lens = [b.nbytes for b in buffers]
        self.item_lens = [b[0].nbytes for b in buffers]
        # --mamba-slots: a Mamba pool as SGLang's MambaPool hands it over, one slot per
        # request in a conv buffer [slot, channels, kernel - 1] and an SSM buffer [slot, heads,
        # head state], both split over attention TP by their channels or heads (SGLang's
        # state_dim_per_tensor: this rank's count of them).
        self.tp_rank = args.tp_rank
        self.mamba = [torch.zeros((args.mamba_slots, total // args.tp_size, width),
                                  dtype=torch.float32)
                      for total, width in MAMBA_SPLIT] if args.mamba_slots else []  # fmt: skip

    def _state_value(self, room_index: int, number: int, local: int) -> float:
        """Channel or head ``local`` of this rank holds a value of its global index."""
        global_index = self.tp_rank * self.mamba[number].shape[1] + local
        return expected(room_index, 60 + global_index, 31, number)

    def fill_state(self, room_index: int, slot: int) -> None:
        for number, buffer in enumerate(self.mamba):
            for local in range(buffer.shape[1]):
                buffer[slot][local].fill_(self._state_value(room_index, number, local))

    def wrong_state(self, room_index: int, slot: int) -> int:
        """Buffers of the slot whose channels or heads do not all hold the room's state."""
        return sum(
            not all(bool((buffer[slot][local] == self._state_value(room_index, number, local))
                         .all()) for local in range(buffer.shape[1]))
            for number, buffer in enumerate(self.mamba))  # fmt: skip

    def scrub_state(self, slot: int) -> None:
        for buffer in self.mamba:
            buffer[slot].zero_()

    def fill(self, room_index: int, pages: list[int]) -> None:
        for pos, page in enumerate(pages):
            for layer in range(self.layers):
                self.k[layer][page].fill_(expected(room_index, pos, layer, 0))
                self.v[layer][page].fill_(expected(room_index, pos, layer, 1))

    def wrong_pages(self, room_index: int, pages: list[int], first_pos: int = 0) -> int:
        """Pages that do not hold the room's KV; ``pages[i]`` holds its page ``first_pos + i``."""
        wrong = 0
        for pos, page in enumerate(pages, start=first_pos):
            for layer in range(self.layers):
                for kv, buffers in ((0, self.k), (1, self.v)):
                    want = expected(room_index, pos, layer, kv)
                    if not bool((buffers[layer][page] == want).all()):
                        wrong += 1
        return wrong

    def scrub(self, pages: list[int]) -> None:
        for page in pages:
            for layer in range(self.layers):
                self.k[layer][page].zero_()
                self.v[layer][page].zero_()


def build_manager(mode: str, args: argparse.Namespace, kv: CpuKv,
                  server_args: Any) -> tuple[Any, Any]:
    import torch
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        get_kv_class,
    )

    backend = TransferBackend(args.backend)
    if args.backend == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            maybe_init_shared_mooncake_transfer_engine,
        )

        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    aux = MetadataBuffers(size=args.aux_slots, hidden_size=args.heads * args.head_dim,
                          hidden_states_dtype=torch.float32,
                          max_sampling_mask_tokens=0,
                          kv_checksum_enabled=args.kv_checksum)  # fmt: skip
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    # As SGLang sets it: the prefill's global TP rank, the decode's attention TP rank.
    kv_args.engine_rank = global_tp_rank(args) if mode == "prefill" else args.tp_rank
    kv_args.pp_rank, kv_args.system_dp_rank = 0, 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "auto"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer, kv_args.prefill_end_layer = 0, args.num_layers
    kv_args.kv_data_ptrs, kv_args.kv_data_lens = list(kv.ptrs), list(kv.lens)
    kv_args.kv_item_lens = list(kv.item_lens)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = []
    kv_args.kv_head_num, kv_args.total_kv_head_num = args.heads // args.tp_size, args.heads
    kv_args.page_size = args.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = aux.get_buf_infos()
    kv_args.ib_device, kv_args.gpu_id = None, 0
    # What setup_state_kv_args sets for a plain MHA pool.
    for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens",
                 "state_dim_per_tensor", "state_slice_outer_counts", "state_layer_ids",
                 "state_conv_shard_groups"):  # fmt: skip
        setattr(kv_args, name, [])
    if kv.mamba:  # what setup_state_kv_args adds for a Mamba pool (one state type)
        from sglang.srt.disaggregation.base.conn import StateType

        kv_args.state_types = [StateType.MAMBA]
        kv_args.state_data_ptrs = [[b.data_ptr() for b in kv.mamba]]
        kv_args.state_data_lens = [[b.nbytes for b in kv.mamba]]
        kv_args.state_item_lens = [[b[0].nbytes for b in kv.mamba]]
        # As MambaPool describes its TP split: this rank's channels or heads per buffer, one
        # row outside the sliced axis, no conv sub-blocks (not GDN).
        kv_args.state_dim_per_tensor = [[b.shape[1] for b in kv.mamba]]
        kv_args.state_slice_outer_counts = [[1] * len(kv.mamba)]
        kv_args.state_conv_shard_groups = [[None] * len(kv.mamba)]
        kv_args.state_layer_ids = [[]]
    kv_args.is_hybrid_mla_backend = False
    kv_args.swa_kv_cache_layout = None
    kv_args.mla_compression_ratios = None
    manager_class = get_kv_class(backend, KVClassType.MANAGER)
    disagg_mode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    manager = manager_class(kv_args, disagg_mode, server_args, False)
    return manager, aux


def reduce_polls(pollers: list[Any], decode_reqs: list[Any] | None = None,
                 metadata_buffers: Any = None) -> list[int]:
    """SGLang's poll reduction; with ``decode_reqs``, its aux-row metadata gate too."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    if not pollers:
        return []
    polls = poll_and_all_reduce(pollers, dist.group.WORLD, decode_reqs=decode_reqs,
                                metadata_buffers=metadata_buffers)  # fmt: skip
    return [int(p) for p in polls]


def failure_of(endpoint: Any) -> str:
    try:
        endpoint.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'failure_reason', exc)}"
    return "no exception raised"


# ---- prefill -----------------------------------------------------------------------------------
def run_prefill(args: argparse.Namespace) -> None:
    # First: the plugin re-binds TransferBackend and get_kv_class before anyone imports them.
    server_args = start_sglang("prefill", args)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(args.backend)
    server = None
    if args.serve_bootstrap and global_tp_rank(args) == 0:  # the launcher's one server
        server_class = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)
        server = server_class(host="127.0.0.1", port=args.bootstrap_port)
    kv = CpuKv(args)
    manager, aux = build_manager("prefill", args, kv, server_args)
    sender_class = get_kv_class(backend, KVClassType.SENDER)
    emit("prefill_ready", pid=os.getpid())
    stall = set(args.stall_room or [])
    served = 0
    deadline = time.monotonic() + args.serve_s
    pending: dict[int, dict[str, Any]] = {}
    next_index = 0
    free_aux = list(range(args.aux_slots))
    last_progress = time.monotonic()
    share = sum(serving_dp_rank(args.room_base + i, args) == args.dp_rank
                for i in range(args.rooms))  # this DP group's rooms
    arrivals = _request_arrivals(args)
    while time.monotonic() < deadline and (args.rooms == 0 or served < share):
        # New requests arrive as the router sends them: one sender per room, as create_sender.
        # With DP, this group gets only the rooms the router sends it.
        arrived = arrivals()
        while next_index < min(args.rooms or 10**9, arrived) and len(pending) < args.aux_slots:
            room, index = args.room_base + next_index, next_index
            next_index += 1
            if serving_dp_rank(room, args) != args.dp_rank:
                continue
            sender = sender_class(mgr=manager, bootstrap_addr=f"127.0.0.1:{args.bootstrap_port}",
                                  bootstrap_room=room)  # fmt: skip
            pending[room] = {"sender": sender, "index": index, "phase": "bootstrap"}
        rooms = list(pending)
        polls = reduce_polls([pending[r]["sender"] for r in rooms])
        progressed = False
        for room, poll in zip(rooms, polls, strict=True):
            entry = pending[room]
            sender = entry["sender"]
            if poll == KVPoll.Failed:
                emit("sender_failed", room=room, phase=entry["phase"], reason=failure_of(sender))
                if "aux" in entry:
                    free_aux.append(entry["aux"])
                del pending[room]
                served += 1
                progressed = True
            elif (entry["phase"] == "bootstrap" and poll == KVPoll.Bootstrapping
                  and args.allocation_policy == "prefill_complete" and "completed" not in entry):
                # prefill_complete: the request was prefilled before bootstrap; its forward
                # pass ended (process_batch_result calls mark_prefill_complete), so the decode
                # may now reserve its pages.
                sender.mark_prefill_complete()
                entry["completed"] = True
                progressed = True
            elif entry["phase"] == "bootstrap" and poll == KVPoll.WaitingForInput:
                # finalize_bootstrap: a metadata buffer, the pages after the prefix the decode
                # already holds (pop_decode_prefix_len), then init(num_pages, aux_index).
                entry["aux"] = free_aux.pop()
                prefix_pages = sender.pop_decode_prefix_len() // args.page_size
                entry["prefix_pages"] = prefix_pages
                sender.init(args.pages_per_room - prefix_pages, entry["aux"])
                # The forward pass's first token, as MetadataBuffers.set_buf writes it.
                aux.output_ids[entry["aux"]][0] = first_token(room)
                aux.bootstrap_room[entry["aux"]][0] = room
                if args.kv_checksum:  # the digest of what is sent, as set_kv_checksum writes it
                    aux.kv_checksum[entry["aux"]][0] = kv_digest(room)
                    aux.kv_checksum[entry["aux"]][1] = CHECKSUM_SIGNATURE
                # The forward pass wrote the room's KV into its source pages.
                span = args.pool_pages - args.pages_per_room
                start = 1 + (entry["index"] * args.pages_per_room) % span
                pages = list(range(start, start + args.pages_per_room))
                kv.fill(entry["index"], pages)
                # The request's Mamba slot (its aux row's index here), named on the last chunk
                # as _mamba_payload gives it: one index array for the one state type.
                state = [[np.asarray(entry["aux"])]] if kv.mamba else None
                if kv.mamba:
                    kv.fill_state(entry["index"], entry["aux"])
                pages = pages[prefix_pages:]  # start_send_idx: the decode holds the rest
                chunks = [pages[i:i + args.chunk_pages]
                          for i in range(0, len(pages), args.chunk_pages)]  # fmt: skip
                if room in stall:
                    chunks = chunks[:1]  # the rest never comes: the room stays in flight
                for number, chunk in enumerate(chunks):
                    last = number == len(chunks) - 1 and room not in stall
                    if sender.should_send_kv_chunk(len(chunk), last):
                        # int32 page ids, as kv_to_page_indices gives them
                        sender.send(np.asarray(chunk, dtype=np.int32), state if last else None)
                entry["phase"] = "inflight"
                progressed = True
                if room in stall:
                    emit("room_stalled", room=room)
            elif entry["phase"] == "inflight" and poll == KVPoll.Success:
                sender.clear()
                metric = sender.get_transfer_metric()
                emit("sender_done", room=room, bytes=metric.transfer_total_bytes,
                     prefix_pages=entry["prefix_pages"])
                free_aux.append(entry["aux"])
                del pending[room]
                served += 1
                progressed = True
        if progressed:
            last_progress = time.monotonic()
        else:
            if time.monotonic() - last_progress > 5.0:
                last_progress = time.monotonic()
                states = {str(r): [pending[r]["phase"], polls[i]] for i, r in enumerate(rooms)}
                emit("prefill_idle", rooms=states)
            time.sleep(TICK_S)
    emit("prefill_finished", served=served, open=len(pending))
    # A scheduler keeps running: give the last status messages time to leave before exiting.
    time.sleep(3600 if args.linger else 2.0)
    del server


def _request_arrivals(args: argparse.Namespace) -> Any:
    """How many of the run's requests have reached this prefill so far, as a function.

    By default all ``--rooms`` are there from the start. With ``--requests-on-stdin`` they come
    as the router would send them, ``{"cmd": "requests", "count": n}`` per batch, at the moment
    the decode gets the same batch: a scheduler then holds (and polls) senders only for the
    requests it was sent, not for every later batch of the run as well.
    """
    if not args.requests_on_stdin:
        return lambda: 10**9
    commands: queue.Queue[int] = queue.Queue()

    def read_requests() -> None:
        for line in sys.stdin:
            if line.strip():
                command = json.loads(line)
                if command.get("cmd") == "requests":
                    commands.put(int(command["count"]))

    threading.Thread(target=read_requests, daemon=True).start()
    arrived = [0]

    def arrivals() -> int:
        while not commands.empty():
            arrived[0] += commands.get_nowait()
        return arrived[0]

    return arrivals


# ---- decode ------------------------------------------------------------------------------------
class DecodeDriver:
    def __init__(self, args: argparse.Namespace) -> None:
        server_args = start_sglang("decode", args)  # first, as in run_prefill
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import (
            KVClassType,
            ReqToMetadataIdxAllocator,
            TransferBackend,
            get_kv_class,
        )

        self.args = args
        # The decode already holds the first --decode-prefix-pages of every room (a prefix
        # match): it receives only the pages after them and says so in decode_prefix_len.
        self.prefix_pages = args.decode_prefix_pages
        self.pages_per_room = args.pages_per_room - args.decode_prefix_pages
        self.kv = CpuKv(args)
        self.manager, self.aux = build_manager("decode", args, self.kv, server_args)
        self.receiver_class = get_kv_class(TransferBackend(args.backend), KVClassType.RECEIVER)
        self.free_pages = list(range(1, args.pool_pages + 1))
        self.aux_alloc = ReqToMetadataIdxAllocator(args.aux_slots)
        self.pending: list[dict[str, Any]] = []
        self.handshake: list[dict[str, Any]] = []
        self.transfer: list[dict[str, Any]] = []
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.topologies: set[str] = set()
        self.batch_started: float | None = None
        self.batch_left = 0
        self.release_times: dict[int, float] = {}
        self.aborted_at: dict[int, float] = {}
        # SGLang's own deferred-release bookkeeping (with the pdflow plugin's hook applied).
        queue_ = object.__new__(DecodeTransferQueue)
        queue_._deferred_releases = []
        queue_.deferred_kv_release_timeout = float(
            os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "30"))
        queue_.enable_host_receive = False
        queue_.enable_staging = False
        queue_.gloo_group = None
        queue_.metadata_buffers = self.aux
        queue_.req_to_metadata_buffer_idx_allocator = self.aux_alloc
        queue_.scheduler = _NoMetrics()
        queue_._release_request = self._release_pages  # free the KV the request held
        self.sglang_queue = queue_
        # SGLang's own prealloc-queue code resolves each request's prefill DP group
        # (_resolve_pending_reqs: the topology through try_ensure_parallel_info, then room %
        # dp_size or its /query_dp_ranks lookups, prefetched on the manager's executor) and
        # calls the receiver's init(prefill_dp_rank).
        prealloc = object.__new__(DecodePreallocQueue)
        prealloc.kv_manager = self.manager
        prealloc.pending_reqs = []
        prealloc._prefill_dp_rank_queries = {}
        prealloc._ensure_retry_count, prealloc._ensure_last_attempt_time = {}, {}
        prealloc._max_ensure_retries, prealloc._ensure_retry_interval = 15, 1.0  # SGLang's
        self.prealloc = prealloc

    # -- what the scheduler's decode loop does, one iteration --------------------------------
    def tick(self) -> bool:
        from sglang.srt.disaggregation.base.conn import KVPoll

        progressed = False
        # The event loop's prefetch, then DecodePreallocQueue._resolve_pending_reqs (SGLang's)
        prealloc = self.prealloc
        prealloc.pending_reqs = [entry["decode_req"] for entry in self.pending]
        prealloc.prefetch_prefill_dp_rank_queries()
        prealloc._resolve_pending_reqs()
        still_pending = {id(decode_req) for decode_req in prealloc.pending_reqs}
        still: list[dict[str, Any]] = []
        for entry in self.pending:
            if id(entry["decode_req"]) in still_pending:
                still.append(entry)
                continue
            addr = entry["addr"]
            info = self.manager.prefill_info_table.get(addr)
            if addr not in self.topologies and info is not None:
                self.topologies.add(addr)
                emit("prefill_topology", bootstrap=addr, dp_size=info.dp_size,
                     follow_bootstrap_room=info.follow_bootstrap_room,
                     policy=str(getattr(info.decode_allocation_policy, "value",
                                        info.decode_allocation_policy)))  # fmt: skip
            self.handshake.append(entry)  # init(prefill_dp_rank) called, or aborted
            progressed = True
        self.pending = still
        # _update_handshake_waiters + pop_preallocated
        polls = reduce_polls([e["receiver"] for e in self.handshake])
        waiting: list[dict[str, Any]] = []
        for entry, poll in zip(self.handshake, polls, strict=True):
            if poll == KVPoll.Failed:
                self.finish(entry, "failed", failure_of(entry["receiver"]))
                progressed = True
            elif poll == KVPoll.WaitingForInput and len(self.free_pages) >= self.pages_per_room:
                pages = [self.free_pages.pop() for _ in range(self.pages_per_room)]
                entry["pages"] = pages
                entry["aux"] = self.aux_alloc.alloc()
                page_indices = np.asarray(pages, dtype=np.int32)
                # The request's Mamba slot: its aux row's index, as on the prefill.
                state = [[np.asarray(entry["aux"])]] if self.kv.mamba else None
                entry["receiver"].send_metadata(
                    page_indices, entry["aux"], state,
                    decode_prefix_len=self.prefix_pages * self.args.page_size)  # fmt: skip
                # Made once, as the scheduler's DecodeRequest is, not on every tick's poll.
                entry["gate"] = _GateView(entry)
                self.transfer.append(entry)
                progressed = True
            else:
                waiting.append(entry)
        self.handshake = waiting
        # DecodeTransferQueue.pop_transferred, through SGLang's aux-row metadata gate
        self.sglang_queue.resolve_deferred_releases()
        polls = reduce_polls([e["receiver"] for e in self.transfer],
                             [e["gate"] for e in self.transfer], self.aux)  # fmt: skip
        left: list[dict[str, Any]] = []
        for entry, poll in zip(self.transfer, polls, strict=True):
            receiver = entry["receiver"]
            if poll == KVPoll.Success:
                wrong = self.kv.wrong_pages(entry["index"], entry["pages"], self.prefix_pages)
                row = entry["aux"]
                aux_ok = (int(self.aux.bootstrap_room[row][0]) == entry["room"]
                          and int(self.aux.output_ids[row][0]) == first_token(entry["room"]))
                checks: dict[str, Any] = {}
                if self.args.kv_checksum:
                    # What _commit_transfer_to_req reads, and whether the scheduler's
                    # _verify_kv_checksums would compare it with its own digest.
                    landed = self.aux.get_kv_checksum(row)
                    aux_ok = aux_ok and landed == (kv_digest(entry["room"]), CHECKSUM_SIGNATURE)
                    checks["verify"] = self.manager.should_verify_kv_checksum(entry["addr"])
                if self.kv.mamba:
                    checks["wrong_state"] = self.kv.wrong_state(entry["index"], row)
                    self.kv.scrub_state(row)
                receiver.clear()
                self.kv.scrub(entry["pages"])
                self.free_pages.extend(entry["pages"])
                self.aux.clear_slot(row)  # as pop_transferred does before freeing the slot
                self.aux.output_ids[row].zero_()
                self.aux_alloc.free(row)
                self.finish(entry, "success", "", wrong_pages=wrong, aux_ok=aux_ok, **checks)
                progressed = True
            elif poll == KVPoll.Failed:
                reason = failure_of(receiver)
                if not receiver.abort_notified:
                    receiver.ensure_abort_notified(force_arm=True)
                # Held (deferred) release: SGLang's own code decides when pages come back.
                request = _HeldRequest(entry)
                self.sglang_queue._defer_release(request)
                entry["held_since"] = time.monotonic()
                self.finish(entry, "failed", reason, held_pages=len(entry["pages"]))
                progressed = True
            else:
                left.append(entry)
        self.transfer = left
        return progressed

    def _release_pages(self, request: _HeldRequest) -> None:
        entry = request.entry
        self.free_pages.extend(entry["pages"])
        self.release_times[entry["room"]] = time.monotonic()
        emit("pages_released", room=entry["room"], pages=len(entry["pages"]),
             held_s=round(time.monotonic() - entry["held_since"], 3))  # fmt: skip

    def finish(self, entry: dict[str, Any], outcome: str, reason: str, **extra: Any) -> None:
        self.outcomes[entry["room"]] = {"outcome": outcome, "reason": reason, **extra}
        emit("receiver_" + outcome, room=entry["room"], reason=reason, **extra)
        if entry.get("batch"):
            self.batch_left -= 1
            if self.batch_left == 0 and self.batch_started is not None:
                elapsed = time.monotonic() - self.batch_started
                outcomes = [self.outcomes[r]["outcome"] for r in self.batch_rooms]
                emit("batch_done", base=self.batch_rooms[0], rooms=len(self.batch_rooms),
                     seconds=round(elapsed, 4),
                     rooms_per_s=round(len(self.batch_rooms) / elapsed, 1),
                     success=outcomes.count("success"),
                     wrong_aux=sum(not self.outcomes[r].get("aux_ok", True)
                                   for r in self.batch_rooms),
                     checksum_verified=sum(bool(self.outcomes[r].get("verify"))
                                           for r in self.batch_rooms),
                     wrong_state=sum(self.outcomes[r].get("wrong_state", 0)
                                     for r in self.batch_rooms),
                     wrong_pages=sum(self.outcomes[r].get("wrong_pages", 0)
                                     for r in self.batch_rooms))  # fmt: skip

    # -- commands ---------------------------------------------------------------------------------
    def batch(self, count: int, base: int, bootstrap_port: int, first_index: int = 0) -> None:
        """``first_index``: the prefill's index of the batch's first room (its KV pattern)."""
        self.batch_started = time.monotonic()
        self.batch_left = count
        self.batch_rooms = [base + i for i in range(count)]
        for index, room in enumerate(self.batch_rooms, start=first_index):
            addr = f"127.0.0.1:{bootstrap_port}"
            receiver = self.receiver_class(mgr=self.manager, bootstrap_addr=addr,
                                           bootstrap_room=room)  # fmt: skip
            # What _resolve_pending_reqs reads of a DecodeRequest and its Req.
            decode_req = SimpleNamespace(
                req=SimpleNamespace(rid=f"req-{room}", bootstrap_host="127.0.0.1",
                                    bootstrap_port=bootstrap_port, bootstrap_room=room,
                                    disagg_prefill_dp_rank=None),
                kv_receiver=receiver, is_rebootstrap=False)  # fmt: skip
            self.pending.append({"room": room, "index": index, "addr": addr,
                                 "receiver": receiver, "batch": True,
                                 "decode_req": decode_req})  # fmt: skip

    def abort(self, room: int) -> None:
        for entry in self.pending + self.handshake + self.transfer:
            if entry["room"] == room:
                entry["receiver"].abort()  # what Scheduler.abort_request does
                self.aborted_at[room] = time.monotonic()
                emit("abort_sent", room=room)
                return
        emit("abort_unknown", room=room)

    def report(self) -> None:
        held = [e[0].entry["room"] for e in self.sglang_queue._deferred_releases]
        emit("report", held=held, free_pages=len(self.free_pages),
             pending=len(self.pending), handshake=len(self.handshake),
             transfer=len(self.transfer),
             states={str(e["room"]): _state(e) for e in self.transfer})  # fmt: skip


def _state(entry: dict[str, Any]) -> int:
    return int(entry["receiver"].poll())


class _GateView:
    """What SGLang's metadata gate reads of a DecodeRequest."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.metadata_buffer_index = entry["aux"]
        self.req = SimpleNamespace(bootstrap_room=entry["room"], bootstrap_host="127.0.0.1")


class _HeldRequest:
    """What DecodeTransferQueue's release code reads of a DecodeRequest."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry = entry
        self.kv_receiver = entry["receiver"]
        self.metadata_buffer_index = entry["aux"]
        self.req = _Req(entry["room"])
        self.host_staged = False


class _Req:
    def __init__(self, room: int) -> None:
        self.bootstrap_room = room


class _NoMetrics:
    class metrics_reporter:  # mirrors Scheduler.metrics_reporter
        enable_metrics = False


def run_decode(args: argparse.Namespace) -> None:
    driver = DecodeDriver(args)
    emit("decode_ready", pid=os.getpid())
    commands: queue.Queue[dict[str, Any]] = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            if line.strip():
                commands.put(json.loads(line))
        commands.put({"cmd": "quit"})

    threading.Thread(target=read_commands, daemon=True).start()
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = None
        if command is not None:
            name = command["cmd"]
            if name == "quit":
                break
            if name == "batch":
                driver.batch(command["count"], command["base"], command["bootstrap_port"],
                             command.get("first_index", 0))
            elif name == "abort":
                driver.abort(command["room"])
            elif name == "report":
                driver.report()
        if not driver.tick():
            time.sleep(TICK_S)
    emit("decode_finished")
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--backend", default="pdflow")
    parser.add_argument("--events-fd", type=int, help="write events here (default stdout)")
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, default=30000)
    parser.add_argument("--serve-bootstrap", action="store_true")
    parser.add_argument("--rooms", type=int, default=0)
    parser.add_argument("--requests-on-stdin", action="store_true",
                        help="prefill: requests arrive as stdin commands {cmd: requests, count}, "
                             "not all at start")
    parser.add_argument("--room-base", type=int, default=1000)
    parser.add_argument("--pages-per-room", type=int, default=4)
    parser.add_argument("--chunk-pages", type=int, default=2)
    parser.add_argument("--stall-room", type=int, action="append")
    parser.add_argument("--serve-s", type=float, default=300.0)
    parser.add_argument("--linger", action="store_true")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--dp-size", type=int, default=1,
                        help="attention DP groups of the instance (prefill: --tp-size each)")
    parser.add_argument("--dp-rank", type=int, default=0, help="prefill: this process's group")
    parser.add_argument("--load-balance-method", default=None,
                        help="SGLang's --load-balance-method (both sides; default SGLang's)")
    parser.add_argument("--gloo-store", default="", help="shared file of the TP ranks' group")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help="the model's KV heads")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--pool-pages", type=int, default=1024)
    parser.add_argument("--aux-slots", type=int, default=256)
    parser.add_argument("--quiet-logs", action="store_true",
                        help="structlog below WARNING off (benchmarks: per-room info lines cost "
                             "time SGLang's managers do not spend)")  # fmt: skip
    parser.add_argument("--decode-prefix-pages", type=int, default=0,
                        help="decode: pages of every room it already holds (decode_prefix_len)")
    parser.add_argument("--allocation-policy", default="early",
                        choices=["early", "prefill_complete"],
                        help="SGLang's --disaggregation-decode-allocation-policy (both sides)")
    parser.add_argument("--mamba-slots", type=int, default=0,
                        help="a Mamba state pool of this many slots (SGLang's StateType.MAMBA)")
    parser.add_argument("--kv-checksum", action="store_true",
                        help="SGLang's KV checksum row in the metadata buffers")
    args = parser.parse_args()
    if args.quiet_logs:
        import logging

        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    global _events
    if args.events_fd is not None:
        _events = os.fdopen(args.events_fd, "w", buffering=1)
    if args.role == "prefill":
        run_prefill(args)
    else:
        run_decode(args)
    os._exit(0)


if __name__ == "__main__":
    main()
