"""What both nodes share: driving one endpoint, its timer, events, transfer queues, room clocks.

An :class:`EndpointHost` owns one core endpoint. Every input goes through :meth:`EndpointHost.
call` (an engine call: the core's refusal is raised to the caller) or :meth:`EndpointHost.feed`
(something the shell observed: a refusal is logged and counted, the node keeps serving). Both
take the host's lock, so one endpoint sees one input at a time, and both carry out every output
of the step, in order, before the lock is released, through the role's one dispatcher
(:mod:`pdflow.core.endpoints.effects`, shared with the simulator) over the node's effects
(:class:`RankEffects` and each node's subclass). The one timer per endpoint is re-armed from
``Step.timer_at`` after every step.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import msgspec
import structlog
import zmq.asyncio
from anyio.abc import ObjectReceiveStream, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pdflow import loop_idle
from pdflow.core.endpoints.endpoint_io import AnyEndpointInput, Dropped, RoomRemoved, TimerFired
from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.outputs import Output, SendMessage, StatusChanged
from pdflow.io.codec import WireCodec
from pdflow.io.control import ControlChannel, PushSocket
from pdflow.io.frame_auth import authenticated
from pdflow.io.limits import SocketPool
from pdflow.io.metrics import NodeMetrics, RoomReport, logs_at
from pdflow.io.metrics_http import MetricsServer, open_metrics_listener
from pdflow.io.settings import Settings
from pdflow.trace.format import message_id
from pdflow.trace.recorder import TraceRecorder

log = structlog.get_logger("pdflow.node")

# After the core refused a timer input, wait this long before firing again (no hot loop).
_TIMER_RETRY_S = 0.1
# Sockets a node needs besides its outgoing pool: one PULL per rank, with room to spare.
_SPARE_SOCKETS = 64
# Trace lines are encoded and written outside the steps (the recorder's `defer`), at the
# loop's next idle point (pdflow.loop_idle) or at the latest this long after a batch's first step.
_TRACE_WRITE_DELAY_S = 0.005


def loop_time() -> float:
    """``anyio.current_time()`` on the nodes' asyncio loop without anyio's backend lookup.

    The same clock (anyio's asyncio backend reads ``loop.time()``), so deadlines compare alike;
    0.2-0.3 us against 1.1-3 us, and a node reads it 9-11 times per room (every step, status
    and room clock). Outside an asyncio loop it is anyio's own answer."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return anyio.current_time()
    return loop.time()


# ---- events: what the embedding engine receives --------------------------------------------------
class RoomStatus(msgspec.Struct, frozen=True, gc=False, tag=True):
    """A room's KVPoll changed on one rank."""

    rank: int
    room: int
    generation: int
    poll: KVPoll
    reason: str = ""


class PagesReleased(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Decode: these pages can no longer be written by anyone; the engine may reuse them."""

    rank: int
    room: int
    generation: int
    pages: tuple[int, ...]


class PagesHeld(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Decode: a failed room's pages are quarantined until the writers listed are cleared."""

    rank: int
    room: int
    generation: int
    pages: tuple[int, ...]
    waiting_on: tuple[PeerId, ...]


class WriterFenced(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Decode: the transport fenced a dead writer on this side; none of its writes can land now.
    Never published where the transport's fence is not real (its pages wait for the drain ACK)."""

    rank: int
    peer: PeerId


class RoomClosed(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The endpoint forgot the room (after ``clear``, or once a failed room drained)."""

    rank: int
    room: int
    generation: int


NodeEvent = RoomStatus | PagesReleased | PagesHeld | WriterFenced | RoomClosed


class EventHub:
    """Fans events out to subscribers and keeps each open room's latest status for waiters."""

    def __init__(self) -> None:
        self._subscribers: list[MemoryObjectSendStream[NodeEvent]] = []
        self._watchers: list[Callable[[NodeEvent], None]] = []
        self._status: dict[tuple[int, int], RoomStatus] = {}
        # One bare loop future per waiting caller, not an anyio.Event: a wait is what each
        # waiting room keeps alive, and the Event's wrapper, deque and coroutines were most
        # of the objects a full collection walks per waiting room (benchmarks/README.md).
        self._waiters: dict[tuple[int, int], list[asyncio.Future[None]]] = {}

    def subscribe(self) -> MemoryObjectReceiveStream[NodeEvent]:
        """A stream of every later event. Unbounded, so a slow reader never stalls an endpoint;
        close it when done."""
        send, receive = anyio.create_memory_object_stream[NodeEvent](math.inf)
        self._subscribers.append(send)
        return receive

    def watch(self, watcher: Callable[[NodeEvent], None]) -> None:
        """Call ``watcher(event)`` with every later event as it is published, on the node's
        loop, inside the step that produced it: for a reader that only records (it must not
        block or await). It saves a stream's hand-over to a reader task per event. A watcher
        that raises is logged and kept; the step and the other readers carry on."""
        self._watchers.append(watcher)

    def publish(self, event: NodeEvent) -> None:
        for watcher in self._watchers:
            try:
                watcher(event)
            except Exception as exc:
                log.error("event_watcher_failed", node_event=type(event).__name__,
                          error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        if isinstance(event, RoomStatus):
            key = (event.rank, event.room)
            self._status[key] = event
            for waiter in self._waiters.pop(key, ()):
                if not waiter.done():  # a cancelled caller's future stays done
                    waiter.set_result(None)
        elif isinstance(event, RoomClosed):
            self._status.pop((event.rank, event.room), None)
        if not self._subscribers:
            return  # no copy of the list per event when nobody subscribed (the adapter watches)
        for stream in list(self._subscribers):
            try:
                stream.send_nowait(event)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._subscribers.remove(stream)

    def status(self, rank: int, room: int) -> RoomStatus | None:
        return self._status.get((rank, room))

    async def wait_status(self, rank: int, room: int, at_least: KVPoll, *, is_open: bool,
                          open_call: str) -> RoomStatus:  # fmt: skip
        """The room's first status (the current one, or a later one) that is Failed or at least
        ``at_least``. A room that is not open (``is_open``, the endpoint's answer) and has no
        status is refused: no status would ever come, and the caller would wait for good."""
        key = (rank, room)
        if not is_open and key not in self._status:
            raise LocalProtocolError(
                f"room {room} is not open on rank {rank}: never opened, or cleared and closed",
                hint=f"open it first ({open_call}); a cleared room id needs a new open",
            )
        while True:
            current = self._status.get(key)
            if current is not None and (current.poll is KVPoll.Failed or current.poll >= at_least):
                return current
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, []).append(waiter)
            try:
                await waiter
            finally:
                if waiter.cancelled():
                    self._forget_waiter(key, waiter)

    def waiting_rooms(self) -> int:
        """How many rooms someone is waiting on (for tests and leak checks)."""
        return len(self._waiters)

    def _forget_waiter(self, key: tuple[int, int], waiter: asyncio.Future[None]) -> None:
        """A cancelled caller's future leaves at once, not at the room's next status, which a
        room that was abandoned may never get."""
        waiters = self._waiters.get(key)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]

    @contextmanager
    def reopening(self, rank: int, room: int) -> Iterator[None]:
        """Around an open: a previous use of the room id is forgotten, and put back if the open
        raises (unless the room has a newer status). A refused open changes nothing, and
        waiters and the decode's page release read this status."""
        dropped = self._status.pop((rank, room), None)
        try:
            yield
        except BaseException:
            if dropped is not None:
                self._status.setdefault((rank, room), dropped)
            raise

    def close(self) -> None:
        for stream in self._subscribers:
            stream.close()
        self._subscribers.clear()
        self._watchers.clear()


# ---- per-room measurements -----------------------------------------------------------------------
class RoomClock:
    """What the node measured of one room instance (room id and generation) on one endpoint."""

    def __init__(self, opened_at: float, generation: int) -> None:
        self.opened_at = opened_at
        self.generation = generation
        self.ready_at: float | None = None
        self.published_at: float | None = None
        self.transfer_s: float | None = 0.0
        self.bytes_moved: int | None = None

    def add_transfer(self, seconds: float | None, nbytes: int) -> None:
        # One unmeasured write makes the room's total unknown, not smaller.
        self.transfer_s = (
            None if seconds is None or self.transfer_s is None else (self.transfer_s + seconds)
        )
        self.bytes_moved = (self.bytes_moved or 0) + nbytes


# ---- one endpoint ------------------------------------------------------------------------------
Effect = Awaitable[object] | None
"""What a node's effect returns: None when it is done, else what the step must await before its
next output (a send waiting for room in the peer's queue, a fence lifted): most effects never
wait, and a coroutine created and awaited per output was part of every step's cost."""

Dispatch = Callable[[Output, str | None], Effect]
"""Carries out one output (the role's dispatcher bound to one rank's effects)."""


class EndpointHost:
    """One core endpoint with its lock, timer and the dispatcher of its outputs."""

    def __init__(
        self,
        endpoint_id: str,
        endpoint: Any,
        rank: int,
        me: PeerId,
        dispatcher: Callable[[EndpointHost], Dispatch],
        metrics: NodeMetrics,
        events: EventHub,
    ) -> None:
        self.endpoint_id = endpoint_id
        self.endpoint = endpoint
        self.rank = rank
        self.me = me
        self.metrics = metrics
        self.events = events
        # Taken without a checkpoint when free: a trip through the event loop on every step
        # was about a tenth of the decode loop's busy samples. asyncio's own lock (the nodes
        # run on anyio's asyncio backend) costs 0.4 us a step against 1.7 us for anyio's
        # fast_acquire lock, which asks for the current task twice (benchmarks/README.md).
        # Serialisation is unchanged, and a contended lock goes to its waiters in FIFO order
        # (a task taking it again queues behind them). What the yield gave for free, the
        # loops that feed steps in bursts now do themselves: the receive loop and the
        # SGLang command loop yield every YIELD_EVERY items, a transfer worker at each job it
        # takes (anyio's stream receive), the timer at each wait; nothing else runs steps
        # back to back. The chaos check of a no-op fence stops the writer inside its writes
        # (pause_mid_write), so it no longer rests on the interleaving this yield made.
        self._lock = asyncio.Lock()
        self.step_started_at: float | None = None
        """When the step in progress took the lock (loop time); None between steps. One that
        never ends leaves the rank deaf to its peers: the health endpoint reports it."""
        self._timer_at: float | None = None
        self._sleeping_until: float | None = None
        self._rearmed = anyio.Event()
        self.clocks: dict[int, RoomClock] = {}
        """The open room's clock per room id; a cleared generation still draining may report
        (and be removed) after the room id's next one opened, so look it up with clock_of."""
        self._dispatch = dispatcher(self)

    def clock_of(self, room: int, generation: int) -> RoomClock | None:
        """The clock of this room instance, if it is the one the room id's clock measures."""
        clock = self.clocks.get(room)
        return clock if clock is not None and clock.generation == generation else None

    async def call(self, inp: AnyEndpointInput) -> Step:
        """An engine call: raises the core's refusal (its state is unchanged)."""
        return await self._drive(inp)

    async def feed(self, inp: AnyEndpointInput) -> Step | None:
        """A shell observation: a refusal is counted and logged, never raised."""
        try:
            return await self._drive(inp)
        except Exception as exc:
            self.metrics.step_errors.labels(type(inp).__name__).inc()
            log.error("step_refused", endpoint=self.endpoint_id, input=type(inp).__name__,
                      error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return None

    async def _drive(self, inp: AnyEndpointInput) -> Step:
        async with self._lock:
            # Stamped for the health endpoint (wedged_ranks), cleared however the step ends.
            now = self.step_started_at = loop_time()
            try:
                step: Step = self.endpoint.handle(inp, now)
                self._rearm(step.timer_at)
                seq = getattr(self.endpoint, "last_seq", None)
                for index, output in enumerate(step.outputs):
                    # Only a sent message carries its id (the dispatchers hand it to `send` alone):
                    # the other outputs of a step skip building the string.
                    msg_id = (
                        message_id(self.endpoint_id, seq, index)
                        if seq is not None and isinstance(output, SendMessage)
                        else None
                    )
                    pending = self._dispatch(output, msg_id)
                    if pending is not None:
                        # The core has moved: every output of the step must be carried out, or a
                        # cancelled caller (its own timeout) would leave the rest undone, e.g. the
                        # ABORT to a second writer, which the core never sends again. Sends are
                        # bounded (ControlChannel), so the shield is too.
                        with anyio.CancelScope(shield=True):
                            await pending
                return step
            finally:
                self.step_started_at = None

    def _rearm(self, timer_at: float | None) -> None:
        self._timer_at = timer_at
        # Wake the timer task only when it must fire sooner than it is set to: a deadline that
        # moved later (or went away) is seen when the task wakes, so most steps wake nothing.
        sleeping = self._sleeping_until
        if timer_at is not None and (sleeping is None or timer_at < sleeping):
            self._rearmed.set()

    async def run_timer(self) -> None:
        """Fire TimerFired at each ``timer_at`` (clamped to now), re-armed by every step."""
        while True:
            self._rearmed = anyio.Event()
            deadline = self._sleeping_until = self._timer_at
            if deadline is None:
                await self._rearmed.wait()
                continue
            with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)):
                await self._rearmed.wait()
                continue
            current = self._timer_at
            if current is None or current > anyio.current_time():
                continue  # moved later or gone while we slept: sleep until the new one
            self._sleeping_until = None
            if await self.feed(TimerFired()) is None:
                await anyio.sleep(_TIMER_RETRY_S)


def wedged_ranks(hosts: Iterable[EndpointHost], limit_s: float) -> str | None:
    """Why this process must answer its health probe 503, or None: each rank whose step has
    held its endpoint lock longer than ``limit_s``. Such a rank handles no message or timer,
    yet the process still answers, so without this the decode would wait out waiting_timeout.
    A step shorter than the limit (its sends, each bounded by the send timeout) never trips it.
    """
    now = loop_time()
    stalled = [
        f"rank {host.rank}'s control step has run {now - host.step_started_at:.1f}s"
        for host in hosts
        if host.step_started_at is not None and now - host.step_started_at > limit_s
    ]
    if not stalled:
        return None
    return (f"{'; '.join(stalled)} (control_stall_limit {limit_s:g}s): the rank is wedged; "
            "restart this prefill process if it does not recover")


class RankEffects:
    """The effects both nodes carry out alike, for one rank: the engine's events, the room
    clocks and metrics, the drop counters. Each node's subclass adds the rest."""

    role = ""

    def __init__(self, host: EndpointHost) -> None:
        self.host = host

    def report_status(self, change: StatusChanged) -> None:
        host = self.host
        now = loop_time()
        clock = host.clock_of(change.room, change.generation)
        if clock is not None and change.poll is KVPoll.WaitingForInput:
            clock.ready_at = now
        if clock is not None and change.poll.is_terminal:
            host.metrics.room_finished(self._report(change, clock, now))
        host.events.publish(
            RoomStatus(host.rank, change.room, change.generation, change.poll, change.reason)
        )
        if change.poll.is_terminal and self.role == "decode":
            # A room's path ends at the decode's terminal status (the waiter it woke runs
            # first). Not at the prefill's: its StatusReport is still on the way to the
            # decode, and a decode on the same loop would receive it behind the write.
            loop_idle.idle_point()

    def forget_room(self, removed: RoomRemoved) -> None:
        if self.host.clock_of(removed.room, removed.generation) is not None:
            del self.host.clocks[removed.room]  # never the clock of the room id's next generation
        self.host.events.publish(RoomClosed(self.host.rank, removed.room, removed.generation))

    def count_drop(self, dropped: Dropped) -> None:
        self.host.metrics.core_dropped.labels(dropped.kind).inc()
        log.info("message_dropped", endpoint=self.host.endpoint_id, kind=dropped.kind,
                 reason=dropped.reason[:200])  # fmt: skip

    def record_only(self, output: Output) -> None:
        if logs_at(logging.DEBUG):  # asking the logger proxy binds a logger first (~3 us)
            log.debug("output", endpoint=self.host.endpoint_id, output=type(output).__name__)

    def _report(self, change: StatusChanged, clock: RoomClock, now: float) -> RoomReport:
        waited = None
        if clock.ready_at is not None and clock.published_at is not None:
            waited = max(clock.published_at - clock.ready_at, 0.0)
        return RoomReport(
            role=self.role, endpoint=self.host.endpoint_id, room=change.room,
            generation=change.generation, outcome=change.poll.name.lower(),
            latency_s=now - clock.opened_at,
            transfer_s=clock.transfer_s if clock.bytes_moved is not None else None,
            allocation_wait_s=waited, bytes_moved=clock.bytes_moved, reason=change.reason,
        )  # fmt: skip


# ---- transfer queues ---------------------------------------------------------------------------
Job = Callable[[int], Awaitable[None]]


class TransferQueues:
    """``count`` FIFO queues, each drained by ``lanes`` workers; a key always maps to the same
    queue, so one slow decode peer holds up only the peers that share its queue, while a peer's
    own rooms still overlap their writes ``lanes`` at a time. A job is told the index of the
    worker running it (``0 .. workers-1``), which it may use for per-worker scratch space."""

    def __init__(self, count: int, lanes: int = 1) -> None:
        if count < 1 or lanes < 1:
            raise ValueError(f"need at least 1 queue and 1 lane, got {count} and {lanes}")
        self.lanes = lanes
        pairs = [anyio.create_memory_object_stream[Job](math.inf) for _ in range(count)]
        self._senders = [send for send, _ in pairs]
        self._receivers = [receive for _, receive in pairs]

    @property
    def workers(self) -> int:
        return len(self._senders) * self.lanes

    def queue_of(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self._senders)

    def submit(self, key: str, job: Job) -> None:
        self._senders[self.queue_of(key)].send_nowait(job)

    def start(self, tasks: TaskGroup) -> None:
        for index, receiver in enumerate(self._receivers):
            for lane in range(self.lanes):
                tasks.start_soon(self._work, receiver.clone(), index * self.lanes + lane)
            receiver.close()  # the clones keep the queue open

    @staticmethod
    async def _work(receiver: MemoryObjectReceiveStream[Job], worker: int) -> None:
        async with receiver:
            async for job in receiver:
                await job(worker)

    def close(self) -> None:
        for sender in self._senders:
            sender.close()


class NodeLifecycle:
    """What both nodes share: their events and metrics, and ``async with`` start and shutdown
    (a failed start unwinds what it began; shutdown cancels the tasks, then releases)."""

    runtime: NodeRuntime
    _stack: AsyncExitStack
    _tasks: TaskGroup

    metrics_address: str | None = None
    """``host:port`` serving ``GET /metrics`` (settings.metrics_port), None when not served."""

    @property
    def metrics_text(self) -> str:
        return self.runtime.metrics.text()

    async def _serve_metrics(self) -> None:
        """Serve ``GET /metrics`` from the node's loop when ``metrics_port`` is set."""
        settings = self.runtime.settings
        if settings.metrics_port is None:
            return
        listener, self.metrics_address = await open_metrics_listener(
            settings.host, settings.metrics_port
        )
        server = MetricsServer(self.runtime.metrics.text, settings.bootstrap_token)

        async def serve() -> None:
            async with listener:  # closed when the node's tasks are cancelled at shutdown
                await listener.serve(server.handle)

        self._tasks.start_soon(serve)
        log.info("metrics_listening", node=self.runtime.node_id, address=self.metrics_address)

    def subscribe(self) -> ObjectReceiveStream[NodeEvent]:
        return self.runtime.events.subscribe()

    def watch(self, watcher: Callable[[NodeEvent], None]) -> None:
        """Call ``watcher`` with every later event as it is published (:meth:`EventHub.watch`);
        call it on the node's loop."""
        self.runtime.events.watch(watcher)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _release(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            await self._release()
            raise
        if self.runtime.settings.collect_garbage_at_start:
            self._collect_start_up_garbage()
        return self

    def _collect_start_up_garbage(self) -> None:
        """One full collection now, so the one start-up left due does not pause the first rooms.

        Python runs a full (generation-2) pass once enough objects have survived since the
        last one; the imports before a node starts leave it due, and the first few hundred
        rooms' allocations then set it off mid-batch (the side-by-side suite's first batch
        ran at a fifth of the others' speed). Paid here, the next one needs a quarter of the
        heap's objects to be new survivors. No collector setting is changed.
        """
        started = time.perf_counter()
        unreachable = gc.collect()
        seconds = round(time.perf_counter() - started, 4)
        log.info("start_up_garbage_collected", node=self.runtime.node_id,
                 unreachable=unreachable, seconds=seconds)  # fmt: skip

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        try:
            self._tasks.cancel_scope.cancel()
            await self._stack.__aexit__(exc_type, exc, tb)
        finally:
            await self._release()


def peer_key(peer: PeerId) -> str:
    return f"{peer.address}#{peer.rank}"


# ---- the parts every node owns -----------------------------------------------------------------
class NodeRuntime:
    """A node's ZMQ context, control channels, trace recorder, metrics and events."""

    def __init__(self, role: str, settings: Settings, incarnation: str, codec: WireCodec) -> None:
        self.role = role
        self.settings = settings
        self.incarnation = incarnation
        # With the cluster token set, every control frame carries a MAC (io/frame_auth.py).
        self.codec = authenticated(codec, settings.bootstrap_token, settings.control_mac_window)
        self.node_id = f"{role}-{incarnation}"
        self.metrics = NodeMetrics(role, self.node_id)
        self.events = EventHub()
        self.context = zmq.asyncio.Context()
        # ZMQ's own cap (1023 by default) must sit above the pool's, or the pool never acts.
        self.context.set(zmq.MAX_SOCKETS, settings.control_max_sockets + _SPARE_SOCKETS)
        self.sockets = SocketPool[PushSocket](
            settings.control_max_sockets,
            on_evict=lambda: self.metrics.evictions.labels("socket").inc(),
        )
        self.channels: list[ControlChannel] = []
        trace_path = Path(settings.trace_dir) / f"{self.node_id}.jsonl"
        self.recorder = TraceRecorder(trace_path, max_bytes=settings.trace_max_bytes,
                                      enabled=settings.trace_enabled,
                                      defer=_write_on_the_loop_later)  # fmt: skip

    def open_channel(self) -> ControlChannel:
        metrics = self.metrics
        channel = ControlChannel.open(
            self.context, self.codec, host=self.settings.host,
            on_drop=metrics.frame_dropped,
            on_send_failed=lambda address: metrics.send_failures.inc(),
            on_refused=metrics.send_refused, pool=self.sockets,
        )  # fmt: skip
        self.channels.append(channel)
        return channel

    def endpoint_id(self, rank: int) -> str:
        return f"{self.node_id}#{rank}"

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels.clear()
        # destroy, not term: it closes any socket still open first, so shutdown cannot hang.
        self.context.destroy(linger=0)
        self.recorder.close()
        self.events.close()


def _write_on_the_loop_later(write: Callable[[], None]) -> None:
    """The trace recorder's deferral: at the running loop's next idle point (a write handed to
    a worker thread, a decode's terminal status), at the latest _TRACE_WRITE_DELAY_S after the
    batch's first step (at once where no loop runs, e.g. a step driven from a plain thread).

    A fixed delay alone landed a batch started by a room's set-up steps on that room's status
    path (the completion step, the StatusReport, the decode's step) in 13-28 of 40 rooms at
    4 MiB (benchmarks/README.md, "One room end to end at 4 MiB"). What is written and in what
    order is unchanged: the recorder's ``write_pending`` writes its batch as before, only
    sooner; close, flush and the recorder's own triggers still write at once."""
    loop_idle.defer(write, _TRACE_WRITE_DELAY_S)


def draw_incarnation() -> str:
    """A fresh id for this process life (the shell draws randomness; the core never does)."""
    return secrets.token_hex(8)
