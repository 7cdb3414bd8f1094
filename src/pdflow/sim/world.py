"""World: a whole PD deployment in one process, every effect simulated and every choice explicit.

One prefill instance (its ranks share an incarnation and register with a bootstrap
:class:`~pdflow.core.cluster.registry.Registry`) and a decode instance of independent ranks, each a
pure endpoint driven by a fake engine (:mod:`pdflow.sim.engine`) over a simulated network and a
fake transport that moves real bytes. Nothing happens unless a driver applies an action (see
:mod:`pdflow.sim.actions`); every endpoint step is checked by the :class:`Monitor` and recorded
in the trace.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from pdflow.core.cluster.registry import (
    PrefillRankInfo,
    PrefillServerInfo,
    QueryRank,
    QueryTopology,
    RegisterRank,
    Registry,
    Reply,
    declared_checksum,
)
from pdflow.core.cluster.topology import (
    AttentionKind,
    Parallelism,
    PdTopology,
    PrefillCoordinates,
    resolve_rank_mapping,
)
from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import KvDtype, packed_layout
from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.effects import carry_out_decode, carry_out_prefill
from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ChecksumChecked,
    ClearRoom,
    DecodeEndpointConfig,
    Dropped,
    HeartbeatResult,
    PrefillEndpointConfig,
    PrefillInfo,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    RoomRemoved,
    TimerFired,
    TopologyFailed,
    TopologyKnown,
)
from pdflow.core.endpoints.liveness import ProbeTarget
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError, ProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import AbortRequested, Input, PublishPages
from pdflow.core.protocol.messages import Abort, PeerId
from pdflow.core.protocol.outputs import (
    StartTransfer,
    StatusChanged,
)
from pdflow.core.protocol.policy import Timeouts
from pdflow.core.resources.admission import (
    AdmissionQueue,
    CancelRequest,
    EnqueueRequest,
    FinishRequest,
    RequestAdmitted,
    RequestRejected,
)
from pdflow.core.resources.page_ledger import PagesFreed, SessionClosed
from pdflow.sim.clock import VirtualClock
from pdflow.sim.effects import DecodeSimEffects, PrefillSimEffects
from pdflow.sim.engine import (
    DecodeProcess,
    PrefillProcess,
    ReceiverJob,
    Request,
    SenderJob,
    admission_budget,
)
from pdflow.sim.faults import FaultPlan
from pdflow.sim.invariants import Monitor
from pdflow.sim.network import Envelope, Network
from pdflow.sim.tracing import TraceWriter
from pdflow.sim.transport import FakeTransport, LocalCheck, Write, aux_content
from pdflow.trace.observe import room_summaries, touched_rooms

BOOTSTRAP = "10.0.9.1:8998"
PREFILL_IP = "10.0.0.1"
PREFILL_PORT = 7000
HEALTH = f"{PREFILL_IP}:9000"
"""The prefill instance's own health endpoint (its ranks register it; the decode probes it)."""
DECODE_IP = "10.0.1.1"
DECODE_PORT = 8000
KV_DTYPE = "auto"


@dataclass(frozen=True)
class LocalEvent:
    """Work a process's shell has queued (a topology fetch, a checksum, a writer's fence)."""

    side: str
    rank: int
    life: int
    kind: str
    payload: Any


class World:
    def __init__(
        self, plan: FaultPlan, *, record: bool = True, mutant: str | None = None
    ) -> None:
        """``mutant``: the name of the mutant core applied around this world, recorded in its
        trace's headers so that replay can say why it diverges."""
        self.plan = plan
        self.shape = plan.shape
        self.rng = random.Random(plan.seed ^ 0x5EED)
        self.clock = VirtualClock()
        self.network = Network(reorder_within_link=plan.reorder_within_link)
        self.trace = TraceWriter(plan.seed, plan.to_builtins(), mutant) if record else None
        self.monitor = Monitor(self)
        self.timeouts = Timeouts(self.shape.bootstrap_timeout, self.shape.waiting_timeout)
        self.prefill_coords = [
            PrefillCoordinates(dp=dp, cp=cp, tp=tp, pp=pp)
            for dp, cp, tp, pp in itertools.product(
                range(self.shape.prefill_dp),
                range(self.shape.prefill_cp),
                range(self.shape.prefill_tp),
                range(self.shape.prefill_pp),
            )
        ]
        self.decode_coords = list(
            itertools.product(
                range(self.shape.decode_dp),
                range(self.shape.decode_tp),
                range(self.shape.decode_pp),
            )
        )
        segments = self.shape.prefill_tp * self.shape.prefill_cp * self.shape.prefill_pp
        self.transport = FakeTransport(segments, self.shape.decode_pages, self._owner_of)
        self.registry = Registry()
        self.incarnations: set[str] = set()
        """Every incarnation drawn so far (see :meth:`_draw_incarnation`)."""
        self.registrations: list[RegisterRank] = []
        """Every prefill registration sent, in order (a dead life's may be retried late)."""
        self.prefill_life = 0
        self.prefill_paused = False
        """The prefill process is stopped (SIGSTOP): alive, but it does nothing and answers no
        probe; once resumed, its late writes may try to land."""
        self.prefill_incarnation = ""
        self.prefill: list[PrefillProcess] = []
        self.decode: list[DecodeProcess] = []
        self.lives: dict[str, int] = {}
        self.requests: list[Request] = []
        self.generations: dict[int, int] = {}
        self.local_events: list[LocalEvent] = []
        self.late_called: set[tuple[str, int, int | None]] = set()
        self.last_delivered: dict[tuple[str, int, int], dict[str, Envelope]] = {}
        """Per process and room instance, the last message of each kind it got (a late copy
        of each may still arrive before the engine clears the room)."""
        self.refused_aborts: list[Abort] = []
        """ABORTs a prefill refused unanswered past max_pending_room_ids: no ACK ever comes,
        exactly as if the network had lost them (liveness counts them so)."""
        """Room instances whose engine made its late calls while settling (once each)."""
        self.steps = 0
        self.actions = 0
        self.core_error: Exception | None = None
        """The last exception a core machine raised (see :meth:`raised_by_core`)."""
        self._start_prefill_instance()
        for rank in range(self.shape.decode_ranks):
            self._start_decode(rank)

    # ---- process lives -----------------------------------------------------------------------
    def _draw_incarnation(self, prefix: str) -> str:
        """A process life's incarnation, never one drawn before in this world: a registration
        reusing a superseded life's would deserve the registry's 409."""
        while True:
            incarnation = f"{prefix}{self.rng.getrandbits(32):08x}"
            if incarnation not in self.incarnations:
                self.incarnations.add(incarnation)
                return incarnation

    def prefill_peer(self, rank: int) -> PeerId:
        return PeerId(f"{PREFILL_IP}:{PREFILL_PORT + rank}", self.prefill_incarnation, rank)

    def _start_prefill_instance(self) -> None:
        """Start (or restart) every prefill rank: one new incarnation shared by all."""
        self.prefill_life += 1
        self.prefill_incarnation = self._draw_incarnation("p")
        self.prefill = []
        for rank in range(self.shape.prefill_ranks):
            config = PrefillEndpointConfig(
                me=self.prefill_peer(rank),
                policy=self.shape.policy,
                timeouts=self.timeouts,
                session_id=f"{PREFILL_IP}:{PREFILL_PORT + rank}",
                max_pending_room_ids=self.shape.max_pending_room_ids,
                max_parked_peers=self.shape.max_parked_peers,
                max_finished_room_ids=self.shape.max_finished_room_ids,
                max_ownerless_ready_rooms=self.shape.max_ownerless_ready_rooms,
            )
            name = f"prefill{rank}.{self.prefill_life}"
            process = PrefillProcess(
                rank,
                self.prefill_life,
                name,
                config,
                PrefillEndpoint(config),
                free_sources=list(range(self.shape.source_pages)),
            )
            self.prefill.append(process)
            self.transport.prefill_started(process.me, self.shape.source_pages)
            if self.trace is not None:
                self.trace.header(name, "prefill", config)
            self._register(rank)

    def _register(self, rank: int) -> None:
        c = self.prefill_coords[rank]
        declared = self.shape.prefill_checksums if self.shape.prefill_declares_checksums else None
        registration = RegisterRank(
            attn_tp_size=self.shape.prefill_tp,
            attn_tp_rank=c.tp,
            attn_cp_size=self.shape.prefill_cp,
            attn_cp_rank=c.cp,
            attn_dp_size=self.shape.prefill_dp,
            attn_dp_rank=c.dp,
            pp_size=self.shape.prefill_pp,
            pp_rank=c.pp,
            system_dp_size=1,
            system_dp_rank=0,
            rank_ip=PREFILL_IP,
            rank_port=PREFILL_PORT + rank,
            page_size=self.shape.page_tokens,
            kv_cache_dtype=KV_DTYPE,
            decode_allocation_policy=self.shape.policy,
            incarnation=self.prefill_incarnation,
            started_at=self.clock.now,
            checksum=declared,
            health=HEALTH,
        )
        self.registrations.append(registration)
        reply = self.ask_registry(registration)
        # By the registry's contract (spec/machines/registry.toml) this registration must be
        # accepted: the world sends no token to a registry that asks none, every field is
        # well-formed and agrees with the other ranks (one shape per world), its incarnation
        # was never used before and it started no earlier than the life it replaces (the
        # virtual clock never goes back). A refusal is the registry's fault, not the world's.
        self.monitor.checking("registry_ordered")
        if reply.status != 200:
            self.monitor.fail(
                "registry_ordered",
                f"the registry refused prefill rank {rank}'s registration of its live "
                f"incarnation {self.prefill_incarnation} (started_at={self.clock.now:g}), "
                f"which its contract accepts: {reply.status} {reply.body}",
            )

    def _start_decode(self, rank: int) -> None:
        life = self.lives.get(f"decode{rank}", 0) + 1
        self.lives[f"decode{rank}"] = life
        dp, tp, pp = self.decode_coords[rank]
        me = PeerId(f"{DECODE_IP}:{DECODE_PORT + rank}", self._draw_incarnation("d"), rank)
        config = DecodeEndpointConfig(
            me=me,
            tp_size=self.shape.decode_tp,
            tp_rank=tp,
            dp_size=self.shape.decode_dp,
            dp_rank=dp,
            pp_size=self.shape.decode_pp,
            pp_rank=pp,
            num_kv_heads=self.shape.num_kv_heads,
            num_pages=self.shape.decode_pages,
            page_size=self.shape.page_tokens,
            kv_cache_dtype=KV_DTYPE,
            is_mla=self.shape.is_mla,
            policy=self.shape.policy,
            timeouts=self.timeouts,
            verify_checksums=self.shape.verify_checksums,
            # Half the worlds announce a layout (KvArgs, answered by KvArgsAccepted): it doubles
            # the decode->prefill traffic of the first messages, so the other half keeps the
            # seeded driver's budget for the rooms themselves.
            kv_layout=self._layout() if self.shape.announces_layout else None,
        )
        name = f"decode{rank}.{life}"
        budget = admission_budget(self.shape.decode_pages, self.shape.page_tokens)
        process = DecodeProcess(
            rank, life, name, config, DecodeEndpoint(config), AdmissionQueue(budget)
        )
        if rank < len(self.decode):
            self.decode[rank] = process
        else:
            self.decode.append(process)
        self.transport.decode_started(rank, me)
        if self.trace is not None:
            self.trace.header(name, "decode", config)

    def _layout(self) -> KvBuffers:
        """A decode rank's KV tensors as its engine would describe them (one layer, K and V)."""
        heads = max(self.shape.num_kv_heads // self.shape.decode_tp, 1)
        layout = packed_layout(base_addr=4096, num_layers=1, num_pages=self.shape.decode_pages,
                               page_size=self.shape.page_tokens, num_heads=heads, head_dim=4,
                               dtype=KvDtype.FP16)  # fmt: skip
        return KvBuffers.from_layout(layout, self.shape.num_kv_heads)

    def crash_prefill(self) -> None:
        """Every prefill rank dies and restarts with a new incarnation; its state is lost."""
        for request in self.requests:
            if request.prefill_life == self.prefill_life:
                request.unopened_prefill.clear()
        self._start_prefill_instance()
        self.prefill_paused = False
        self.local_events = [e for e in self.local_events if e.side != "prefill"]

    def pause_prefill(self) -> None:
        self.prefill_paused = True

    def resume_prefill(self) -> None:
        self.prefill_paused = False

    def probe(self, target: ProbeTarget) -> HeartbeatResult:
        """What a heartbeat probe of ``target`` sees: the prefill process answers at its own
        health address unless it is stopped; the registry (an external one) always answers,
        without an incarnation."""
        if target.health is None:
            return HeartbeatResult(target.bootstrap, True, None)
        up = target.health == HEALTH and not self.prefill_paused
        incarnation = self.prefill_incarnation if up else None
        return HeartbeatResult(target.bootstrap, up, incarnation, target.health)

    def crash_decode(self, rank: int) -> None:
        for request in self.requests:
            if request.decode_lives.get(rank) == self.decode[rank].life:
                request.unopened_decode.discard(rank)
        self._start_decode(rank)

    # ---- topology ----------------------------------------------------------------------------
    def topology(self) -> PdTopology:
        s = self.shape
        return PdTopology(
            prefill=Parallelism(tp=s.prefill_tp, cp=s.prefill_cp, pp=s.prefill_pp, dp=s.prefill_dp),
            decode=Parallelism(tp=s.decode_tp, pp=s.decode_pp, dp=s.decode_dp),
            attention=AttentionKind.MLA if s.is_mla else AttentionKind.MHA,
            num_kv_heads=s.num_kv_heads,
        )

    def writers_of(self, decode_rank: int, room: int) -> list[int]:
        """Prefill ranks writing into this decode rank's pages for ``room``, in segment order."""
        dp, tp, pp = self.decode_coords[decode_rank]
        mapping = resolve_rank_mapping(
            self.topology(),
            decode_engine_rank=dp * self.shape.decode_tp + tp,
            room=room,
            decode_pp_rank=pp,
        )
        return [self.prefill_coords.index(t.rank) for t in mapping.writers]

    def prefill_ranks_of(self, room: int) -> tuple[int, ...]:
        group = room % self.shape.prefill_dp
        return tuple(i for i, c in enumerate(self.prefill_coords) if c.dp == group)

    def _answer_topology(self) -> TopologyKnown | TopologyFailed:
        reply = self.ask_registry(QueryTopology())
        if reply.status != 200:
            return TopologyFailed(BOOTSTRAP, f"registry answered {reply.status}: {reply.body}")
        server = msgspec.convert(reply.body, PrefillServerInfo)
        ranks = []
        answers = []
        for c in self.prefill_coords:
            answer = self.ask_registry(QueryRank(c.dp, c.cp, c.tp, c.pp))
            info = msgspec.convert(answer.body, PrefillRankInfo)
            answers.append(info)
            self.monitor.checking("registry_ordered")
            if info.incarnation != self.prefill_incarnation:
                self.monitor.fail(
                    "registry_ordered",
                    f"the registry names incarnation {info.incarnation} for prefill rank {c}, "
                    f"superseded by {self.prefill_incarnation}",
                )
            port = info.rank_port
            peer = PeerId(f"{info.rank_ip}:{port}", info.incarnation or "", port - PREFILL_PORT)
            ranks.append(RegisteredPrefillRank(dp=c.dp, cp=c.cp, tp=c.tp, pp=c.pp, peer=peer,
                                               health=info.health))
        # The registry does not carry the attention kind; both sides of a world agree on it.
        return TopologyKnown(
            PrefillInfo(
                bootstrap=BOOTSTRAP,
                tp_size=server.attn_tp_size,
                cp_size=server.attn_cp_size,
                pp_size=server.pp_size,
                dp_size=server.dp_size,
                page_size=server.page_size or 0,
                kv_cache_dtype=server.kv_cache_dtype or "",
                policy=server.decode_allocation_policy,
                ranks=tuple(ranks),
                is_mla=self.shape.is_mla,
                follow_bootstrap_room=server.follow_bootstrap_room,
                checksum=declared_checksum(answers),
            )
        )

    # ---- feeding endpoints -------------------------------------------------------------------
    def feed(self, process: PrefillProcess | DecodeProcess, inp: AnyEndpointInput) -> Step:
        """One core step of one endpoint: check it, record it, carry out its outputs."""
        endpoint = process.endpoint
        before = set(endpoint.open_rooms())
        now = self.clock.now
        try:
            with self._core_boundary():
                step = endpoint.handle(inp, now)
        except Exception as exc:  # recorded, then re-raised: the driver decides what it means
            self._record(process, inp, Step(timer_at=endpoint.timer_at()), exc)
            raise
        seq = self._record(process, inp, step, None)
        self.steps += 1
        refused = any(isinstance(o, Dropped) and o.kind == "unopened_full" for o in step.outputs)
        if refused and isinstance(inp, Received) and isinstance(inp.message, Abort):
            self.refused_aborts.append(inp.message)
        self.monitor.observe(process, inp, step, before)
        for index, output in enumerate(step.outputs):
            msg_id = f"{process.name}:{seq}:{index}"
            if isinstance(process, PrefillProcess):
                carry_out_prefill(PrefillSimEffects(self, process), output, msg_id)
            else:
                carry_out_decode(DecodeSimEffects(self, process), output, msg_id)
        return step

    # ---- the core's other entry points -------------------------------------------------------
    @contextlib.contextmanager
    def _core_boundary(self) -> Iterator[None]:
        """What escapes a core machine here is the core's own error, remembered so that a run
        ending on it reports no_core_error; any other exception is a bug of the simulator."""
        self.monitor.checking("no_core_error")
        try:
            yield
        except Exception as exc:
            self.core_error = exc
            raise

    def raised_by_core(self, exc: BaseException) -> bool:
        return exc is self.core_error

    def admission_step(self, process: DecodeProcess, inp: Input) -> Step:
        with self._core_boundary():
            step = process.admission.handle(inp, self.clock.now)
        self.monitor.record_fired(step.fired)
        return step

    def ask_registry(self, request: Input) -> Reply:
        with self._core_boundary():
            return self.registry.reply_to(request, self.clock.now)

    def _record(
        self,
        process: PrefillProcess | DecodeProcess,
        inp: AnyEndpointInput,
        step: Step,
        error: Exception | None,
    ) -> int:
        if self.trace is None:
            return self.steps
        touched = touched_rooms(inp, step if error is None else None)
        rooms = room_summaries(process.endpoint, touched)
        return self.trace.step(
            self.clock.now,
            process.name,
            inp,
            step.outputs,
            step.fired,
            rooms,
            step.timer_at,
            error,
        )

    def queue_local(
        self, process: PrefillProcess | DecodeProcess, kind: str, payload: Any
    ) -> None:
        side = "prefill" if isinstance(process, PrefillProcess) else "decode"
        self.local_events.append(LocalEvent(side, process.rank, process.life, kind, payload))

    def run_local_event(self, index: int) -> None:
        event = self.local_events.pop(index)
        if event.side != "decode" or self.decode[event.rank].life != event.life:
            return  # the process that asked has died
        process = self.decode[event.rank]
        if event.kind == "topology":
            if self.network.is_cut((BOOTSTRAP, process.me.address)):
                # The shell's fetch cannot reach the bootstrap server: it fails, as over HTTP.
                unreachable = TopologyFailed(BOOTSTRAP, "bootstrap server unreachable")
                self.feed(process, unreachable)
            else:
                self.feed(process, self._answer_topology())
        elif event.kind == "fence":
            if process.endpoint.ledger.verdict_lifted(event.payload):
                return  # readmitted meanwhile: the shell has no verdict left to enforce
            self.transport.fence(process.rank, event.payload)
            self.feed(process, SessionClosed(event.payload))
        elif event.kind == "checksum":
            # Like the node, the world finishes the work and answers whatever the core did
            # meanwhile: the scatter writes the pages it started on; a late answer is dropped.
            check: LocalCheck = event.payload
            verify = check.request
            self.transport.local_write(process.rank, verify.room, verify.generation, check.pages)
            self.monitor.check_writes()  # a scatter into freed pages, before the core answers
            self.feed(process, self._check_checksums(process, check))

    def _check_checksums(self, process: DecodeProcess, check: LocalCheck) -> ChecksumChecked:
        verify = check.request
        if not check.pages:
            return ChecksumChecked(verify.room, verify.generation, False, "room is gone")
        bad = []
        for peer, expected in verify.expected:
            segment = self.writers_of(process.rank, verify.room).index(peer.rank)
            actual = self.transport.checksum_of(process.rank, check.pages, segment)
            if actual != expected:
                bad.append(f"{peer.address}: expected {expected:#x}, got {actual:#x}")
        return ChecksumChecked(verify.room, verify.generation, not bad, "; ".join(bad))

    # ---- engine reactions --------------------------------------------------------------------
    def status_changed(
        self, process: PrefillProcess | DecodeProcess, change: StatusChanged
    ) -> None:
        job = process.jobs.get(change.room)
        if job is None or job.request.generation != change.generation:
            return
        job.poll = change.poll
        if isinstance(process, PrefillProcess):
            return
        assert isinstance(job, ReceiverJob)
        if change.poll is KVPoll.WaitingForInput and job.stage == "resolving":
            self._enqueue(process, job)
        elif change.poll is KVPoll.Success:
            self.monitor.decode_succeeded(process, change.room)

    def _enqueue(self, process: DecodeProcess, job: ReceiverJob) -> None:
        request = job.request
        step = self.admission_step(
            process, EnqueueRequest(request.rid, request.input_len, request.max_new)
        )
        if any(isinstance(o, RequestRejected) for o in step.outputs):
            job.stage = "rejected"
            self.feed(process, RoomCall(request.room, AbortRequested("rejected by admission")))
            return
        job.stage = "queued"
        process.requests[request.rid] = job

    def admit(self, process: DecodeProcess) -> None:
        """The decode scheduler admits what fits and publishes each admitted room's pages."""
        from pdflow.core.resources.admission import AdmitRequests

        step = self.admission_step(process, AdmitRequests())
        for output in step.outputs:
            if isinstance(output, RequestAdmitted):
                self._publish(process, process.requests[output.request_id], output.reserve_pages)

    def _publish(self, process: DecodeProcess, job: ReceiverJob, count: int) -> None:
        free = process.endpoint.free_pages()
        self.monitor.checking("admission_consistent")
        if len(free) < count:
            self.monitor.fail(
                "admission_consistent",
                f"{process.name}: admission granted {count} pages for room {job.request.rid} but "
                f"the ledger has only {len(free)} free",
            )
            return
        job.pages = tuple(sorted(self.rng.sample(free, count)))
        job.stage = "admitted"
        room = job.request.room
        self.feed(process, PublishPages(room, job.pages, aux_index=room % 8))

    def pages_freed(self, process: DecodeProcess, freed: PagesFreed) -> None:
        rid = f"{freed.room}/{freed.generation}"
        job = process.requests.pop(rid, None)
        if job is not None and job.stage == "admitted":
            job.stage = "finished"
            self.admission_step(process, FinishRequest(rid))

    def room_removed(self, process: PrefillProcess | DecodeProcess, removed: RoomRemoved) -> None:
        self.monitor.room_removed(process, removed.room, removed.generation)
        job = process.jobs.get(removed.room)
        if job is not None and job.request.generation == removed.generation:
            del process.jobs[removed.room]
        else:
            job = None
        if isinstance(process, PrefillProcess):
            assert job is None or isinstance(job, SenderJob)
            drained = process.draining_jobs.pop((removed.room, removed.generation), None)
            for done in (job, drained):
                if done is not None:
                    self.give_back_sources(process, done.src_pages)
            return
        assert job is None or isinstance(job, ReceiverJob)
        if job is not None and job.stage == "queued":
            job.stage = "cancelled"
            process.requests.pop(job.request.rid, None)
            self.admission_step(process, CancelRequest(job.request.rid))

    def give_back_sources(
        self, process: PrefillProcess, pages: tuple[int, ...], *, first: bool = False
    ) -> None:
        """The prefill engine frees a room's source pages: free to hand out again (``first``:
        the next ones handed out, as if never taken)."""
        self.transport.release_sources(process.me, pages)
        if first:
            process.free_sources[:0] = pages
        else:
            process.free_sources.extend(pages)

    def clear(self, process: PrefillProcess | DecodeProcess, room: int) -> None:
        """The engine clears a terminal room; a prefill room still draining leaves the engine's
        view at once, its source pages pinned until the endpoint reports it removed."""
        self.feed(process, ClearRoom(room))
        if isinstance(process, PrefillProcess):
            job = process.jobs.get(room)
            if job is not None and process.endpoint.is_draining(room, job.request.generation):
                del process.jobs[room]
                process.draining_jobs[(room, job.request.generation)] = job

    # ---- message delivery --------------------------------------------------------------------
    def process_at(self, address: str) -> PrefillProcess | DecodeProcess:
        for process in self.processes():
            if process.me.address == address:
                return process
        raise KeyError(f"no process listens on {address}")

    def deliver(self, envelope: Envelope) -> None:
        process = self.process_at(envelope.to.address)
        self.network.delivered(envelope)
        message = envelope.message
        room, generation = getattr(message, "room", None), getattr(message, "generation", None)
        if isinstance(room, int) and isinstance(generation, int):
            kind = f"{type(message).__name__}.{getattr(message, 'status', '')}"
            self.last_delivered.setdefault((process.name, room, generation), {})[kind] = envelope
        self.feed(process, Received(envelope.message, envelope.msg_id))

    # ---- writes ------------------------------------------------------------------------------
    def start_write(self, process: PrefillProcess, start: StartTransfer) -> None:
        target_rank = start.peer.rank
        writers = self.writers_of(target_rank, start.room)
        self.transport.add(
            Write(
                wid=self.transport.next_write_id(),
                writer_rank=process.rank,
                writer=process.me,
                target_rank=target_rank,
                target=start.peer,
                room=start.room,
                generation=start.generation,
                seq=start.seq,
                dst_pages=start.dst_pages,
                segment=writers.index(process.rank),
                src_pages=start.src_pages,
                aux=None
                if start.src_aux_index is None
                else aux_content(start.room, start.generation),
            )
        )

    def writer_process(self, write: Write) -> PrefillProcess | None:
        """The prefill process that can still report this write (None: it has died)."""
        process = self.prefill[write.writer_rank]
        return process if process.me == write.writer else None

    # ---- timers ------------------------------------------------------------------------------
    def running(self) -> Iterator[PrefillProcess | DecodeProcess]:
        """The processes that act (a stopped prefill's timers do not fire)."""
        if not self.prefill_paused:
            yield from self.prefill
        yield from self.decode

    def next_deadline(self) -> float | None:
        deadlines = [p.endpoint.timer_at() for p in self.running()]
        present = [d for d in deadlines if d is not None]
        return min(present) if present else None

    def fire_timers(self) -> None:
        now = self.clock.now
        for process in self.running():
            due = process.endpoint.timer_at()
            if due is not None and due <= now:
                self.feed(process, TimerFired())

    # ---- requests ----------------------------------------------------------------------------
    def room_busy(self, room: int) -> bool:
        if any(p.endpoint.is_open(room) for p in self.processes()):
            return True
        return any(
            r.room == room and (r.unopened_prefill or r.unopened_decode) for r in self.requests
        )

    def active_requests(self) -> list[Request]:
        return [r for r in self.requests if self.room_busy(r.room)]

    def new_request(self, hint: int) -> Request:
        # The router reuses room ids at any moment, as a retry does (the next generation):
        # while an earlier generation still drains, is open, or was never opened somewhere.
        known = sorted(self.generations)
        if self.plan.room_reuse and known and hint % 2 == 0:
            room = known[(hint // 2) % len(known)]
        else:
            room = max(self.generations, default=-1) + 1
        generation = self.generations.get(room, 0) + 1
        self.generations[room] = generation
        input_len = 1 + (hint >> 3) % (4 * self.shape.page_tokens)
        decode_group = (hint >> 7) % self.shape.decode_dp
        decode_ranks = tuple(
            i for i, (dp, _, _) in enumerate(self.decode_coords) if dp == decode_group
        )
        prefill_ranks = self.prefill_ranks_of(room)
        request = Request(
            room=room,
            generation=generation,
            input_len=input_len,
            max_new=(hint >> 9) % 9,
            num_pages=-(-input_len // self.shape.page_tokens),
            prefill_ranks=prefill_ranks,
            decode_ranks=decode_ranks,
            prefill_life=self.prefill_life,
            decode_lives={r: self.decode[r].life for r in decode_ranks},
            unopened_prefill=set(prefill_ranks),
            unopened_decode=set(decode_ranks),
        )
        self.requests.append(request)
        return request

    def open_prefill(self, request: Request, rank: int) -> None:
        from pdflow.core.endpoints.endpoint_io import OpenRoom

        request.unopened_prefill.discard(rank)
        process = self.prefill[rank]
        take = request.num_pages
        sources = tuple(process.free_sources[:take])
        del process.free_sources[:take]
        self.transport.fill_sources(process.me, sources, request.room, request.generation, rank)
        process.jobs[request.room] = SenderJob(request, sources)
        try:
            self.feed(process, OpenRoom(request.room, request.generation))
        except (InvalidInput, LocalProtocolError):
            # The endpoint refused the claim (a later generation of the room id was opened
            # here already) and changed nothing: the engine fails this request on this rank.
            del process.jobs[request.room]
            self.give_back_sources(process, sources, first=True)

    def open_decode(self, request: Request, rank: int) -> None:
        from pdflow.core.endpoints.endpoint_io import OpenReceiver

        request.unopened_decode.discard(rank)
        process = self.decode[rank]
        process.jobs[request.room] = ReceiverJob(request)
        self.feed(process, OpenReceiver(request.room, request.generation, BOOTSTRAP))

    def mark_complete(self, process: PrefillProcess, room: int) -> None:
        from pdflow.core.protocol.inputs import PrefillCompleted

        process.jobs[room].computed = True
        self.feed(process, RoomCall(room, PrefillCompleted()))

    # ---- checks ------------------------------------------------------------------------------
    def _owner_of(self, decode_rank: int, page: int) -> tuple[int, int] | None:
        return self.decode[decode_rank].endpoint.page_holder(page)

    def processes(self) -> Iterator[PrefillProcess | DecodeProcess]:
        yield from self.prefill
        yield from self.decode

    def expect_refusal(
        self, process: PrefillProcess | DecodeProcess, inp: AnyEndpointInput
    ) -> None:
        """Feed an input the endpoint must refuse with a typed error, changing nothing."""
        before = msgspec.json.encode(process.endpoint.snapshot())
        self.monitor.checking("duplicate_claim_fails")
        try:
            self.feed(process, inp)
        except ProtocolError:
            self.monitor.checking("refusal_changes_nothing")
            after = msgspec.json.encode(process.endpoint.snapshot())
            if after != before:
                self.monitor.fail(
                    "refusal_changes_nothing",
                    f"{process.name}: a refused {type(inp).__name__} changed state",
                )
            return
        self.monitor.fail(
            "duplicate_claim_fails",
            f"{process.name}: {type(inp).__name__} was accepted, not refused",
        )

    def take_or_refuse(
        self, process: PrefillProcess | DecodeProcess, inp: AnyEndpointInput
    ) -> bool:
        """Feed an input the endpoint may take or refuse; a refusal must change nothing.
        True when it was taken."""
        before = msgspec.json.encode(process.endpoint.snapshot())
        try:
            self.feed(process, inp)
        except (ProtocolError, InvalidInput):
            self.monitor.checking("refusal_changes_nothing")
            if msgspec.json.encode(process.endpoint.snapshot()) != before:
                self.monitor.fail(
                    "refusal_changes_nothing",
                    f"{process.name}: a refused {type(inp).__name__} changed state",
                )
            return False
        return True

    def is_live(self, name: str) -> bool:
        return any(p.name == name for p in self.processes())
