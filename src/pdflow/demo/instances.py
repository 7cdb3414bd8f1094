"""The demo's two instances on loopback: each with its own transport engine, pdflow node,
control sockets and (for the prefill) the bootstrap registry it serves, as in SGLang.

An instance runs inside its own cancel scope, so the demo can stop the prefill abruptly (its
sockets and registry vanish mid-transfer, the way a killed process's do) and start a new one,
with a new incarnation, on the same bootstrap address.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.to_thread

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.demo.aux_rows import AuxRows
from pdflow.demo.engines import DecodeEngine, PrefillEngine, RoomOutcome, rank_kv
from pdflow.demo.kvcache import PagedKVCache
from pdflow.demo.link import LinkTransport, PrefillLink, RoomTaggingNode
from pdflow.demo.model import TinyTransformer
from pdflow.demo.state_slots import MemorySlots
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import Settings
from pdflow.transport import InProcessFabric
from pdflow.transport.base import Transport


def mooncake_problem() -> str | None:
    """Why the Mooncake Transfer Engine cannot be used here, or None when it can."""
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: a shared library it needs is missing
        return f"{type(exc).__name__}: {exc}"
    return None


class TransportFactory:
    """Makes one transport engine per instance: Mooncake TCP when installed, else in-process."""

    def __init__(self, kind: str, protocol: str = "tcp") -> None:
        self.kind = self._choose(kind)
        self.protocol = protocol
        self._fabric: InProcessFabric | None = None

    @staticmethod
    def _choose(kind: str) -> str:
        if kind != "auto":
            return kind
        return "inprocess" if mooncake_problem() else "mooncake"

    @contextlib.asynccontextmanager
    async def open(self, link: PrefillLink | None = None) -> AsyncIterator[Transport]:
        """A new transport engine; a prefill's is seen through its ``link``."""
        transport: Transport
        if self.kind == "mooncake":
            from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport

            config = MooncakeConfig(host="127.0.0.1", protocol=self.protocol)
            transport = await anyio.to_thread.run_sync(MooncakeTransport.open, config)
        else:
            if self._fabric is None:
                self._fabric = InProcessFabric()
            transport = self._fabric.create_transport()
        async with transport:
            yield transport if link is None else LinkTransport(transport, link)


STOPPED = RoomOutcome(KVPoll.Failed, "the prefill instance stopped", stopped=True)


class PendingResult:
    """A result another task will deliver (or fail to, if its instance dies)."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: RoomOutcome | None = None
        self.transferred: RoomOutcome | None = None
        """Set once every rank's transfer completed, before the engine clears the room: the
        decode's verified Success stands even if the instance stops after this."""

    def set(self, value: RoomOutcome) -> None:
        if not self.done.is_set():
            self.value = value
            self.done.set()

    async def get(self) -> RoomOutcome:
        await self.done.wait()
        assert self.value is not None
        return self.value


class PrefillInstance:
    """One life of the prefill instance (TP=2). ``run`` serves until cancelled."""

    def __init__(self, model: TinyTransformer, caches: Sequence[PagedKVCache],
                 settings: Settings, transports: TransportFactory, bootstrap: str,
                 staging_slot_bytes: int, link: PrefillLink, rows: int) -> None:  # fmt: skip
        """``rows``: aux rows and state slots per rank, one per request the router may have
        in flight (a room's are freed before its attempt returns)."""
        self.model = model
        self.caches = list(caches)
        self.aux = [AuxRows(rows) for _ in self.caches]
        self.memory = [MemorySlots(model.config.d_model, rows) for _ in self.caches]
        self.link = link
        self.settings = settings
        self.transports = transports
        self.bootstrap = bootstrap
        self.staging_slot_bytes = staging_slot_bytes
        self.ready = anyio.Event()
        self.incarnation = ""
        self._pending: set[PendingResult] = set()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._engine: PrefillEngine | None = None
        self._scope = anyio.CancelScope()
        self.stopped = anyio.Event()

    def kill(self) -> None:
        """Stop abruptly: no room is finished or failed politely; peers must notice."""
        self._scope.cancel()

    async def run(self) -> None:
        try:
            with self._scope:
                await self._serve()
        finally:
            for pending in list(self._pending):
                pending.set(STOPPED)
            self.stopped.set()

    async def _serve(self) -> None:
        async with (
            self.transports.open(self.link) as transport,
            RoomTaggingNode(ranks=[rank_kv(c, a, m) for c, a, m in zip(self.caches, self.aux,
                                                                       self.memory, strict=True)],
                            transport=transport,
                            bootstrap=self.bootstrap, settings=self.settings,
                            staging_slot_bytes=self.staging_slot_bytes) as node,
            anyio.create_task_group() as tasks,
        ):  # fmt: skip
            self.bootstrap = node.bootstrap
            self.incarnation = node.incarnation
            self._engine = PrefillEngine(self.model, self.caches, self.aux, self.memory, node)
            self._tasks = tasks
            self.ready.set()
            await anyio.sleep_forever()

    async def abort(self, room: int, reason: str) -> None:
        if self._engine is not None and not self._scope.cancel_called:
            await self._engine.abort(room, reason)

    def submit(self, room: int, generation: int, prompt: Sequence[int]) -> PendingResult:
        pending = PendingResult()
        if self._tasks is None or self._engine is None or self._scope.cancel_called:
            pending.set(RoomOutcome(KVPoll.Failed, "the prefill instance is not running"))
            return pending
        self._pending.add(pending)
        engine = self._engine

        def transferred(outcome: RoomOutcome) -> None:
            pending.transferred = outcome

        async def job() -> None:
            try:
                pending.set(await engine.serve(room, generation, prompt, transferred))
            except Exception as exc:  # an engine error fails this request, not the instance
                # In a stopped instance this is its sockets closing under it: report the stop.
                pending.set(
                    STOPPED
                    if self._scope.cancel_called
                    else RoomOutcome(KVPoll.Failed, f"prefill engine error: {exc!r}")
                )
            finally:
                # Cancelled with its instance: the waiter must still hear of it (no-op if set).
                pending.set(STOPPED)
                self._pending.discard(pending)

        self._tasks.start_soon(job)
        return pending


@contextlib.asynccontextmanager
async def decode_instance(model: TinyTransformer, cache: PagedKVCache, settings: Settings,
                          transports: TransportFactory, staging_bytes: int,
                          rows: int) -> AsyncIterator[DecodeEngine]:  # fmt: skip
    """``rows`` aux rows (one per request in flight) and twice as many state slots: a failed
    room's slot stays remote-writable until its pages come back, and over Mooncake those of
    rooms in flight with a stopped prefill never do (at most ``rows`` of them)."""
    aux = AuxRows(rows)
    memory = MemorySlots(model.config.d_model, 2 * rows)
    async with (
        transports.open() as transport,
        DecodeNode(ranks=[rank_kv(cache, aux, memory)], transport=transport, settings=settings,
                   staging_bytes=staging_bytes) as node,
        anyio.create_task_group() as tasks,
    ):  # fmt: skip
        engine = DecodeEngine(model, cache, aux, memory, node)
        tasks.start_soon(engine.watch_events)
        yield engine
        tasks.cancel_scope.cancel()
