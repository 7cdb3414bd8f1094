"""Mooncake Transfer Engine transport (TCP here, RDMA in production).

Each op is submitted as its own engine transfer (`transfer_submit_write`) and polled to a
terminal state (`transfer_check_status`), with at most `max_outstanding_ops` submitted at once
per worker job; a peer's ops are polled in submission order, only its oldest unsettled one
each sweep, and while 64 or more are on the wire the worker pauses 200 us after every sweep.
Why not one `batch_transfer_sync_write` per batch:

- the engine reports a batch FAILED as soon as one op fails, while its sibling ops may still be
  on the wire; per-op tracking lets `batch_write` return only once every submitted op is
  settled, which is what makes `close_session` a real fence;
- the TCP transport rejects ops beyond a per-peer queue (about 2048 ops measured here; a batch
  of 4096 x 4 KiB fails), and the window keeps us under it without splitting by guesswork;
- measured on loopback it is as fast as the engine's batch call (see benchmarks/transport_raw),
  and it sleeps between sweeps where the batch call spins a core in C++ until the batch ends.

Over TCP the engine (mooncake-transfer-engine-non-cuda 0.3.13) sends a peer's ops on a few
persistent connections (`MC_TCP_LANES_PER_PEER`, 4), one op per connection at a time, each
acknowledged by the receiver once its bytes are in memory; ops beyond that wait in a per-peer
queue (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`, 1024, then as many pending admissions that
fail after `MC_TCP_ADMISSION_TIMEOUT_MS`, 1 s). pdflow sets none of these; on a 2-core VM
loopback runs at 1.1-1.3 GB/s for 64 KiB ops, CPU-bound in the two engines' io threads and
the kernel's copies (benchmarks/README.md, fifth pass).

Engine calls block, so writes are polled in `max_concurrent_calls` long-lived worker threads
(`worker_threads.py`: one wake into a thread and one back per job); a job's first
`_LOOP_SUBMIT_OPS` ops are submitted from the event loop before that wake (a submit only
queues the op in the engine), so they are on the wire while the thread wakes. A small call
(at most 1 MiB in at most `_LOOP_SUBMIT_OPS` ops) skips the jobs: it is submitted from the
loop when it is made and polled there, up to 2 ms (then a worker thread takes what is left),
by one shared poller that sweeps every small call in flight, yields the core and the loop
once per sweep, and wakes each call as it settles (`_write_polled`); no wake back from a
thread on a small room's path, and no room waits for a job to be free. The calls polled that
way have one window of `max_outstanding_ops` between them, as a job has. Past it, and for
larger calls, concurrent calls (up to 1 MiB each) are coalesced, every call queued while the
workers were busy going into the next worker job (one thread hop, one submit/poll loop for
many rooms' writes); a larger call gets a job of its own, so no small room waits behind its
bytes. A worker is never abandoned on cancellation: cancelling `batch_write` waits for the
engine to settle its ops.

No receiver-side fence (`fence_is_real` is False). Over TCP the receiving engine checks a
request's destination range against its registered buffers once, when the request header
arrives (`ServerSession::readHeader` calls `validateTcpAddress`), then streams the body straight
into that memory in `MC_TCP_SLICE_SIZE` (64 KiB) reads with no further check
(`ServerSession::readBody`, tcp_transport_session_impl.h). The server keeps no table of its
sessions, the header names no sender, and the Python binding has no call that drops a peer's
connections or removes its endpoint. So unregistering a buffer refuses only requests whose
header arrives later, and a paused writer's accepted request lands when it resumes
(tests/integration/test_mooncake_transport.py shows it). Over RDMA the mechanism exists in the
engine (docs/operations.md, "Fencing a dead writer") but the binding does not expose it.

What does cut every peer at once is destroying the engine (its io thread joined, every
connection closed), so the transport fences by rotation (`can_rotate`): `rotate` opens a second
engine in this process with the same buffers registered (a new session id, new rpc port) and
makes it current; `retire` destroys the old one, after which no write through it can land (a
paused writer's accepted request fails when it resumes:
tests/integration/test_mooncake_transport.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Self

import anyio
import anyio.to_thread
import msgspec

from pdflow import loop_idle
from pdflow.transport.base import (
    RegistrationError,
    RotationUnavailableError,
    TransferOutcome,
    TransportError,
)
from pdflow.transport.guarded import CheckedWrite, GuardedTransport
from pdflow.transport.worker_threads import WorkerThreads

SUPPORTED_PROTOCOLS = ("tcp", "rdma")
_STATUS_COMPLETED = 1
_STATUS_FAILED = -1
# Calls up to this many bytes are coalesced into shared worker jobs; larger ones run alone.
_COALESCE_MAX_BYTES = 1 << 20
# Idle pause between status sweeps that saw no progress; short next to one 4 KiB op (~60 us).
_POLL_PAUSE_S = 20e-6
# While this many ops are on the wire the engine has work queued for every connection to
# the peer (even 4 KiB ops take ~40 us of engine CPU each here, so 64 are milliseconds of
# it), and the worker pauses this long after every sweep, progress or not, instead of
# spinning on the op that just settled: benchmarks/README.md, fifth pass.
_BUSY_OPS = 64
_BUSY_PAUSE_S = 200e-6
# A job's first ops are submitted from the event loop, before the hop into its worker thread
# (each submit a few us; a 1 MiB room is 4 ops): the wire does not wait for the thread to wake.
_LOOP_SUBMIT_OPS = 8
# A job of at most this many bytes, all of it submitted from the loop, is polled from the loop
# itself for up to _LOOP_POLL_S before it goes to a worker thread (MooncakeTransport._settle):
# a 1 MiB room is about 0.5 ms on the wire here. At 4 MiB the loop's polling (2-3 ms of a
# core) slowed the engine's io threads more than the hop back costs: benchmarks/README.md.
_LOOP_POLL_MAX_BYTES = 1 << 20
_LOOP_POLL_S = 2e-3


class MooncakeConfig(msgspec.Struct, frozen=True):
    """Where and how the engine listens. `protocol` is "tcp" (tests) or "rdma" (production)."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    device_name: str = ""
    max_concurrent_calls: int = 2
    max_outstanding_ops: int = 512


def load_engine_class() -> Any:
    """Import Mooncake's `TransferEngine`, keeping only its errors unless MC_LOG_LEVEL is set."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(
            "Mooncake is not installed: run scripts/setup.sh (installs "
            "mooncake-transfer-engine-non-cuda and libibverbs1/librdmacm1)"
        ) from exc
    return TransferEngine


def _start_engine(config: MooncakeConfig) -> tuple[Any, str]:
    """A new engine listening on `config.host` and its session id, "host:rpc_port"."""
    engine = load_engine_class()()
    status = engine.initialize(
        config.host, config.metadata_server, config.protocol, config.device_name
    )
    if status != 0:
        raise TransportError(
            f"Mooncake engine failed to initialise (status {status}) on host "
            f"{config.host!r} with protocol {config.protocol!r}; check the host address "
            "and, for rdma, that RDMA devices are present"
        )
    return engine, f"{config.host}:{engine.get_rpc_port()}"


def _is_batch_id(handle: int) -> bool:
    # The binding signals a refused submit with 0 or with -1 wrapped to an unsigned 64-bit int.
    return 0 < handle < 2**64 - 1


class _WriteCall:
    """One ``batch_write`` waiting for (or in) a worker-thread job."""

    def __init__(self, peer: str, writes: Sequence[CheckedWrite]) -> None:
        self.peer = peer
        self.writes = writes
        self.taken = False
        self.settled = anyio.Event()
        self.outcome: TransferOutcome | None = None
        self.error: Exception | None = None

    def result(self) -> TransferOutcome:
        if self.error is not None:
            raise self.error
        assert self.outcome is not None, "a settled call has an outcome or an error"
        return self.outcome


class _CallProgress:
    """One call's ops inside a worker-thread job: what was submitted, landed, failed."""

    def __init__(self, peer: str, writes: Sequence[CheckedWrite]) -> None:
        self.peer = peer
        self.writes = writes
        self.next_index = 0
        self.outstanding = 0
        self.failed: list[int] = []
        self.landed_ops = 0
        self.landed_bytes = 0
        self.seconds: float | None = None

    def outcome(self, elapsed: float) -> TransferOutcome:
        seconds = self.seconds if self.seconds is not None else elapsed
        if not self.failed:
            return TransferOutcome(ok=True, nbytes=self.landed_bytes, nops=self.landed_ops,
                                   seconds=seconds)  # fmt: skip
        first_index = min(self.failed)
        first = self.writes[first_index]
        return TransferOutcome(
            ok=False,
            nbytes=self.landed_bytes,
            nops=self.landed_ops,
            seconds=seconds,
            error=(
                f"{len(self.failed)} of {len(self.writes)} ops failed and "
                f"{len(self.writes) - self.next_index} were not submitted; first failed op "
                f"{first_index} wrote [{first.dst_addr:#x}, +{first.length}) at {self.peer}: "
                "the peer is unreachable or that range is not registered there"
            ),
        )


class _WriteJob:
    """Every call of one worker job through one bounded window of ops: submit, then poll until
    each submitted op is settled; one outcome per call.

    After a call's first failure none of its further ops is submitted, but those already
    submitted are still awaited: returning earlier would let them land after a
    `close_session`. The other calls carry on.

    Ops are polled per peer in submission order, each sweep stopping at a peer's first op
    still on the wire: the engine serves a peer's ops in that order on a few connections,
    so the ops behind it are seldom done yet, and checking them all (every call a GIL
    release) cost the worker several times the CPU of the submits (benchmarks/README,
    fifth pass). Every submitted op is still polled until it is settled.
    """

    def __init__(self, engine: Any, window: int,
                 calls: Sequence[tuple[str, Sequence[CheckedWrite]]]) -> None:  # fmt: skip
        self._engine = engine
        self._window = window
        self.calls = [_CallProgress(peer, writes) for peer, writes in calls]
        # Per peer, in submission order: (engine batch id, call, op index).
        self._pending: dict[str, deque[tuple[int, _CallProgress, int]]] = {}
        self._unsubmitted = [p for p in self.calls if p.writes]
        self.nbytes = sum(write.length for _peer, writes in calls for write in writes)
        self.outstanding = 0
        self._started = time.perf_counter()

    def submit(self, limit: int) -> None:
        """Submit ops, in call order, while the window has room: at most ``limit`` of them."""
        engine, pending, unsubmitted = self._engine, self._pending, self._unsubmitted
        while unsubmitted and self.outstanding < self._window and limit > 0:
            call = unsubmitted[0]
            if call.failed:  # an op of it failed while polling: submit no more of it
                unsubmitted.pop(0)
                continue
            limit -= 1
            write = call.writes[call.next_index]
            try:
                handle = engine.transfer_submit_write(
                    call.peer, write.src_addr, write.dst_addr, write.length
                )
            except Exception:  # e.g. an address the binding cannot convert
                # A refused op, like a refused handle: raising here would leave the ops
                # already submitted unpolled, and batch_write would return while they land.
                handle = 0
            if _is_batch_id(handle):
                pending.setdefault(call.peer, deque()).append((handle, call, call.next_index))
                call.outstanding += 1
                self.outstanding += 1
            else:
                call.failed.append(call.next_index)
            call.next_index += 1
            if call.next_index >= len(call.writes) or call.failed:
                unsubmitted.pop(0)

    @property
    def all_submitted(self) -> bool:
        return not self._unsubmitted

    def sweep(self) -> bool:
        """Check each peer's ops in submission order up to its first one still on the wire;
        True if any op settled. Never blocks."""
        engine, started = self._engine, self._started
        settled_any = False
        for queue in self._pending.values():
            while queue:
                handle, call, index = queue[0]
                status = engine.transfer_check_status(handle)
                if status == _STATUS_COMPLETED:
                    call.landed_ops += 1
                    call.landed_bytes += call.writes[index].length
                elif status == _STATUS_FAILED:
                    call.failed.append(index)
                else:  # waiting, or a timeout report while the op is still on the wire
                    break
                queue.popleft()
                settled_any = True
                self.outstanding -= 1
                call.outstanding -= 1
                if call.outstanding == 0 and (call.failed or call.next_index >= len(call.writes)):
                    call.seconds = time.perf_counter() - started
        return settled_any

    def outcomes(self) -> list[TransferOutcome]:
        elapsed = time.perf_counter() - self._started
        return [call.outcome(elapsed) for call in self.calls]

    def settle(self) -> list[TransferOutcome]:
        """Submit the rest and poll until every submitted op is settled (blocks: run it in a
        worker thread)."""
        while self.outstanding or self._unsubmitted:
            self.submit(self._window)
            settled_any = self.sweep()
            if self.outstanding >= _BUSY_OPS:
                time.sleep(_BUSY_PAUSE_S)
            elif self.outstanding and not settled_any:
                time.sleep(_POLL_PAUSE_S)
        return self.outcomes()


class _PolledCall:
    """One small call's job, submitted at once and polled from the loop by the shared poller
    until it is settled or its polling time is up (then a worker thread takes it over)."""

    __slots__ = ("deadline", "finished", "handed_off", "job", "peer", "woken")

    def __init__(self, peer: str, job: _WriteJob, deadline: float) -> None:
        self.peer = peer
        self.job = job
        self.deadline = deadline
        self.finished = False
        self.handed_off = False
        self.woken = anyio.Event()
        """Set when the call finished, or when the poller's role is free for it to take."""


class MooncakeTransport(GuardedTransport):
    """A pdflow `Transport` over one Mooncake `TransferEngine`; build with `open()`."""

    def __init__(self, engine: Any, session_id: str, config: MooncakeConfig) -> None:
        super().__init__()
        self._engine = engine
        self._session_id = session_id
        self._config = config
        self._writers = WorkerThreads(config.max_concurrent_calls, "mooncake-write")
        # batch_write calls not yet taken by a worker-thread job (see _engine_write).
        self._queued: list[_WriteCall] = []
        self._worker_freed = anyio.Event()
        self._jobs_running = 0
        # Small calls polled from the loop (_write_polled): one sweep serves all of them.
        self._polled: list[_PolledCall] = []
        self._polled_ops = 0
        self._poller: _PolledCall | None = None
        # Engines of earlier sessions, still serving their rooms until `retire` destroys them.
        self._retiring: dict[str, Any] = {}

    @classmethod
    def open(cls, config: MooncakeConfig | None = None) -> Self:
        """Start an engine listening on `config.host`; its session id is "host:rpc_port"."""
        config = config or MooncakeConfig()
        if config.protocol not in SUPPORTED_PROTOCOLS:
            raise TransportError(
                f"unsupported Mooncake protocol {config.protocol!r}; use one of "
                f"{', '.join(SUPPORTED_PROTOCOLS)}"
            )
        if config.max_concurrent_calls < 1 or config.max_outstanding_ops < 1:
            raise TransportError("max_concurrent_calls and max_outstanding_ops must be >= 1")
        engine, session_id = _start_engine(config)
        return cls(engine, session_id, config)

    @property
    def can_rotate(self) -> bool:
        return True

    @property
    def retiring_sessions(self) -> tuple[str, ...]:
        """Earlier sessions whose engines still run (rotated away from, not yet retired)."""
        return tuple(self._retiring)

    async def rotate(self) -> str:
        """Open a second engine, register every buffer with it, and make it the current one."""
        self._check_open()
        engine, session_id = await anyio.to_thread.run_sync(_start_engine, self._config)
        try:
            for addr, length in self._regions.regions():
                status = engine.register_memory(addr, length)
                if status != 0:
                    raise RegistrationError(
                        f"the new Mooncake engine refused [{addr:#x}, +{length}) (status "
                        f"{status}); the current engine {self._session_id} stays in use"
                    )
        except BaseException:
            await anyio.to_thread.run_sync([engine].clear)
            raise
        self._retiring[self._session_id] = self._engine
        self._engine, self._session_id = engine, session_id
        return session_id

    async def retire(self, session_id: str) -> None:
        """Destroy the engine of an earlier session (its io thread joined, its connections
        closed); waits first for this transport's own writes in flight. The destructor holds
        the GIL for about a second: the whole process, event loop included, stalls that long."""
        self._check_open()
        if session_id not in self._retiring:
            raise RotationUnavailableError(
                f"{session_id!r} is not an earlier session of this transport (current "
                f"{self._session_id!r}, retiring {sorted(self._retiring)}); rotate first"
            )
        await self._inflight.wait_all_idle()
        engine = self._retiring.pop(session_id)
        for addr, _length in self._regions.regions():
            engine.unregister_memory(addr)
        await anyio.to_thread.run_sync([engine].clear)

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def config(self) -> MooncakeConfig:
        return self._config

    @property
    def fence_is_real(self) -> bool:
        """False: nothing reachable from here stops a peer's accepted write (module docstring)."""
        return False

    def _engine_register(self, addr: int, length: int) -> None:
        status = self._engine.register_memory(addr, length)
        if status != 0:
            raise RegistrationError(
                f"Mooncake refused to register [{addr:#x}, +{length}) (status {status})"
            )

    def _engine_unregister(self, addr: int) -> None:
        for retiring in self._retiring.values():  # an earlier engine must not take it either
            retiring.unregister_memory(addr)
        status = self._engine.unregister_memory(addr)
        if status != 0:
            raise RegistrationError(f"Mooncake refused to unregister {addr:#x} (status {status})")

    async def _engine_write(self, peer: str, writes: Sequence[CheckedWrite]) -> TransferOutcome:
        """Queue the call's writes; whichever caller finds a worker free takes every call
        queued so far into one worker-thread job (one thread hop for many rooms' writes).

        Once its writes are taken the caller waits shielded: cancelling it never returns
        before the engine has settled them (the fence contract of ``batch_write``).
        """
        nbytes = sum(write.length for write in writes)
        if (
            nbytes <= _LOOP_POLL_MAX_BYTES
            and len(writes) <= _LOOP_SUBMIT_OPS
            and self._polled_ops + len(writes) <= self._config.max_outstanding_ops
        ):
            return await self._write_polled(peer, writes)
        job = _WriteCall(peer, writes)
        if nbytes > _COALESCE_MAX_BYTES:
            # A large write gets a job of its own: small rooms never wait behind its bytes.
            job.taken = True
            await self._run_calls([job])
            return job.result()
        self._queued.append(job)
        try:
            while not job.taken:
                if self._jobs_running < self._config.max_concurrent_calls:
                    await self._run_queued()
                else:
                    await self._worker_freed.wait()
        except BaseException:
            if not job.taken:
                self._queued.remove(job)
                raise
        if not job.settled.is_set():  # the caller that ran the job has its outcome already
            with anyio.CancelScope(shield=True):
                await job.settled.wait()
        return job.result()

    async def _write_polled(self, peer: str, writes: Sequence[CheckedWrite]) -> TransferOutcome:
        """A small call, submitted now from the loop and polled there with every other small
        call in flight: one sweep, one yield of the core and one trip through the loop serve
        them all, where a job each spun on its own and calls queued for one of the
        `max_concurrent_calls` jobs. Past _LOOP_POLL_S a worker thread sees its ops settled.
        Everything after the submit runs shielded: a cancelled caller returns only once every
        op is settled (the fence contract of ``batch_write``)."""
        self._writers.check_open()  # before any op is on the wire
        job = _WriteJob(self._engine, len(writes), [(peer, writes)])
        self._polled_ops += len(writes)
        try:
            job.submit(len(writes))
            with anyio.CancelScope(shield=True):
                if job.outstanding:
                    call = _PolledCall(peer, job, time.perf_counter() + _LOOP_POLL_S)
                    self._polled.append(call)
                    await self._until_settled(call)
                    if call.handed_off:
                        # Nothing of it to do on the loop until the thread returns: an idle
                        # point, where deferred work such as trace batches is done.
                        loop_idle.idle_point()
                        return (await self._writers.run(self._write_settled, job))[0]
            return job.outcomes()[0]
        finally:
            self._polled_ops -= len(writes)

    async def _until_settled(self, call: _PolledCall) -> None:
        """Wait for the poller to finish ``call``; be the poller while nobody else is."""
        while not call.finished:
            if self._poller is None:
                self._poller = call
                try:
                    await self._poll_until_finished(call)
                finally:
                    self._poller = None
                    if self._polled:  # the role passes to a call still on the wire
                        self._polled[0].woken.set()
            else:
                await call.woken.wait()
                call.woken = anyio.Event()

    async def _poll_until_finished(self, mine: _PolledCall) -> None:
        """Sweep the polled calls until ``mine`` is finished, waking each other one that
        finishes; offer the core to the engine's io threads (they move the bytes) and the
        loop to every other ready task between sweeps.

        As in a job's own sweep, a peer's calls are checked in submission order up to the
        first one still on the wire: the engine serves a peer's ops in about that order, and
        every check is an engine call (a GIL release). Every call is still checked until it is
        settled, or handed to a worker thread once its polling time is up."""
        while not mine.finished:
            settled_any = False
            now = time.perf_counter()
            on_the_wire: list[_PolledCall] = []
            waiting_peers: set[str] = set()  # peers whose oldest call is still on the wire
            for call in self._polled:
                if now >= call.deadline:
                    call.handed_off = bool(call.job.outstanding)  # time up: a worker thread's
                elif call.peer not in waiting_peers:
                    if call.job.sweep():
                        settled_any = True
                    if call.job.outstanding:
                        waiting_peers.add(call.peer)
                if call.job.outstanding and not call.handed_off:
                    on_the_wire.append(call)
                    continue
                call.finished = True
                call.woken.set()
            self._polled = on_the_wire
            if mine.finished:
                return
            if not settled_any:
                os.sched_yield()
            await asyncio.sleep(0)

    async def _run_queued(self) -> None:
        calls, self._queued = self._queued, []
        await self._run_calls(calls)

    async def _run_calls(self, calls: list[_WriteCall]) -> None:
        """One worker-thread job for these calls; each gets its outcome (or the job's error).

        The job's first ops are submitted here, on the loop, so they are on the wire while the
        worker thread wakes (0.05-0.08 ms here, most of a small room's hop into the thread);
        the thread submits the rest and polls every submitted op until it is settled (a small
        job is polled on the loop instead: `_settle`). Everything after the submit runs
        shielded, so a cancelled caller cannot leave a submitted op unpolled.
        """
        for call in calls:
            call.taken = True
        self._jobs_running += 1
        try:
            job = _WriteJob(self._engine, self._config.max_outstanding_ops,
                            [(c.peer, c.writes) for c in calls])  # fmt: skip
            self._writers.check_open()  # before any op is on the wire
            job.submit(_LOOP_SUBMIT_OPS)
            # Taken writes are always seen through: a cancelled caller waits for them.
            with anyio.CancelScope(shield=True):
                outcomes = await self._settle(job)
        except Exception as exc:
            for call in calls:
                call.error = exc
        else:
            for call, outcome in zip(calls, outcomes, strict=True):
                call.outcome = outcome
        finally:
            self._jobs_running -= 1
            for call in calls:
                call.settled.set()
            freed, self._worker_freed = self._worker_freed, anyio.Event()
            freed.set()

    async def _settle(self, job: _WriteJob) -> list[TransferOutcome]:
        """Poll a small job's ops from the loop itself, or hand the job to a worker thread.

        A job of at most _LOOP_POLL_MAX_BYTES whose ops are all submitted is polled here
        between yields to the loop, up to _LOOP_POLL_S; the completion is then seen without
        the wake back from a worker thread (0.09-0.15 ms of a 1 MiB room's ~0.5 ms on the
        wire here) and without the worker's sweeps taking the GIL meanwhile. Whatever is
        still on the wire after that goes to a worker thread. The caller holds a shield, so
        a cancelled caller still returns only once every op is settled.
        """
        if job.nbytes <= _LOOP_POLL_MAX_BYTES and job.all_submitted:
            deadline = time.perf_counter() + _LOOP_POLL_S
            while job.outstanding and time.perf_counter() < deadline:
                if not job.sweep():
                    # Offer this core to the engine's io threads (they move the bytes), then
                    # let the loop run whatever else is ready.
                    os.sched_yield()
                    await asyncio.sleep(0)
            if not job.outstanding:
                return job.outcomes()
        # The loop has nothing of this job to do until the thread returns (the bytes are on
        # the wire): an idle point, where deferred work such as trace batches is done.
        loop_idle.idle_point()
        return await self._writers.run(self._write_settled, job)

    def _write_settled(self, job: _WriteJob) -> list[TransferOutcome]:
        """(In a worker thread) the rest of the job: see _WriteJob.settle."""
        return job.settle()

    async def _engine_shutdown(self) -> None:
        # Dropping the last reference runs the engine's destructor, which joins its threads
        # and takes about a second. It holds the GIL throughout (measured: no other Python
        # thread ran meanwhile), so the worker thread spares the loop nothing while it runs.
        holder = [self._engine, *self._retiring.values()]
        self._engine = None
        self._retiring.clear()
        self._writers.close()  # no write is in flight: aclose waited for them
        await anyio.to_thread.run_sync(holder.clear)
