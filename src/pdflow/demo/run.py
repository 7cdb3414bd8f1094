"""`pdflow demo`: a real prefill (TP=2) and decode (TP=1) on loopback, driven by a small router.

For each request the router picks a bootstrap room and a generation, starts the decode (which
reserves pages and publishes them through pdflow) and the prefill (which computes the prompt's
KV with the tiny model and sends it, staged, through pdflow, with the first token in the
request's aux row, which pdflow lands in the decode's aux slot: the router only routes), and checks
that the decode's tokens equal a single-process run of the same model. A failed attempt is
retried on the same room id with the next generation, so room reuse is exercised too.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import msgspec

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.demo.engines import DecodeEngine, RoomOutcome
from pdflow.demo.instances import PrefillInstance, TransportFactory, decode_instance
from pdflow.demo.kvcache import PagedKVCache
from pdflow.demo.model import ModelConfig, TinyTransformer, generate_reference, make_prompts
from pdflow.io.settings import Settings, load_settings

MAX_ATTEMPTS = 5
RETRY_BACKOFF_S = 0.25
"""A retry waits attempt x this: long enough for the decode's heartbeat to notice a prefill that
died or restarted (two probes at 0.5 s in the demo), so the next attempt meets the new life."""


class DemoOptions(msgspec.Struct, frozen=True):
    requests: int = 12
    prompt_len: int = 40
    max_new: int = 12
    concurrency: int = 4
    transport: str = "auto"
    faults: bool = False
    seed: int = 0
    out_dir: str = "out/demo"


class RequestRecord(msgspec.Struct):
    index: int
    room: int
    attempts: int = 0
    ok: bool = False
    tokens: list[int] = msgspec.field(default_factory=list)
    expected: list[int] = msgspec.field(default_factory=list)
    failures: list[str] = msgspec.field(default_factory=list)
    ttft_s: float | None = None
    handshake_s: float | None = None
    transfer_s: float | None = None
    kv_bytes: int = 0


class DemoReport(msgspec.Struct, kw_only=True):
    transport: str
    requests: int
    succeeded: int
    tokens_equal: bool
    attempts: int
    tokens_generated: int
    bytes_moved: int
    transfer_gbps: float | None
    handshake_ms_p50: float | None
    handshake_ms_p99: float | None
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    pages_quarantined: int
    pages_held_for_dead_writers: int
    """Of the quarantined pages, those waiting on a stopped prefill that the decode's transport
    cannot fence (Mooncake TCP): expected, and held for good (docs/operations.md)."""
    pages_leaked: int
    faults: list[str]
    traces: list[str]
    timeline: str | None = None
    wall_s: float
    records: list[RequestRecord]


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Router:
    """Assigns rooms, pairs the two instances, retries failed attempts, keeps the score."""

    def __init__(self, options: DemoOptions, decode: DecodeEngine,
                 start_prefill: Callable[[], PrefillInstance],
                 notes: Callable[[str], None]) -> None:  # fmt: skip
        self.options = options
        self.decode = decode
        self.start_prefill = start_prefill
        self.prefill: PrefillInstance | None = None
        self.notes = notes
        self.rng = random.Random(options.seed)
        # Rooms are random 63-bit integers in production; small distinct ones read better here.
        self.room_base = self.rng.randrange(1_000, 9_000) * 100
        self.aborts = set(self.rng.sample(range(options.requests),
                                          k=max(1, options.requests // 5)))  # fmt: skip
        # The prefill is stopped while this request's KV is in flight.
        self.kill_request = options.requests // 2 if options.faults else None
        if self.kill_request is not None:
            self.aborts.discard(self.kill_request)
        self.faults: list[str] = []
        self.stopped_incarnations: set[str] = set()
        self.spawn: Callable[[Callable[[], Awaitable[None]]], None] | None = None

    async def run_request(self, record: RequestRecord, prompt: list[int]) -> None:
        for attempt in range(MAX_ATTEMPTS):
            record.attempts += 1
            abort_at = 0.0 if self.options.faults and attempt == 0 and (
                record.index in self.aborts) else None  # fmt: skip
            outcome = await self._attempt(record, prompt, attempt, abort_at)
            if outcome is None:
                return
            record.failures.append(outcome)
            if abort_at is not None:
                self.fault(f"request {record.index}: aborted by the decode mid-transfer; retried "
                           f"on room {record.room} generation {attempt + 1}")
            if attempt + 1 < MAX_ATTEMPTS:
                await anyio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        record.ok = False

    def fault(self, text: str) -> None:
        self.faults.append(text)

    async def kill_and_restart(self) -> None:
        old = self.prefill
        if old is None:
            return
        self.prefill = None  # new attempts wait for the next life of the prefill
        old.kill()
        await old.stopped.wait()  # its sockets are closed: the address can be served again
        self.stopped_incarnations.add(old.incarnation)
        held = ("freed once the decode fenced the dead writer on its receiving side"
                if self.decode.node.transport.fence_is_real else
                "held for good: Mooncake TCP cannot fence a writer on the receiving side and "
                "a stopped writer never sends its drain ACK")  # fmt: skip
        self.fault(f"prefill instance {old.incarnation} stopped abruptly while request "
                   f"{self.kill_request}'s KV was in flight; the decode failed the rooms it "
                   "had with it (heartbeat or incarnation change) and quarantined their "
                   f"pages, {held}")
        self.prefill = self.start_prefill()
        await self.prefill.ready.wait()
        self.fault(f"prefill restarted as incarnation {self.prefill.incarnation} on the same "
                   "bootstrap address; the decode kept running and served the retries")
        self.notes(self.faults[-1])

    async def _attempt(self, record: RequestRecord, prompt: list[int], generation: int,
                       abort_at: float | None) -> str | None:  # fmt: skip
        """One try; None on success, else why it failed."""
        while self.prefill is None or not self.prefill.ready.is_set():
            await anyio.sleep(0.05)
        prefill = self.prefill
        prefill_result = prefill.submit(record.room, generation, prompt)

        kill_now = None
        if record.index == self.kill_request and generation == 0 and self.spawn is not None:
            spawn = self.spawn
            kill_now = lambda: spawn(self.kill_and_restart)  # noqa: E731
        decoded = await self.decode.serve(
            record.room, generation, prefill.bootstrap, len(prompt), self.options.max_new,
            abort_after_publish=abort_at, on_published=kill_now,
        )
        if decoded.poll is KVPoll.Failed and not prefill_result.done.is_set():
            # The decode side gave up: do not let the prefill wait out its bootstrap timer.
            await prefill.abort(record.room, f"the decode failed: {decoded.reason}")
        sent: RoomOutcome = await prefill_result.get()
        if decoded.poll is KVPoll.Success and sent.poll is KVPoll.Success:
            record.ok = True
            record.tokens = decoded.tokens
            record.ttft_s = decoded.ttft_s
            record.handshake_s = decoded.handshake_s
            record.transfer_s = sent.transfer_s
            record.kv_bytes = sent.kv_bytes
            return None
        return (
            f"generation {generation}: decode {decoded.reason or decoded.poll.name}; "
            f"prefill {sent.reason or sent.poll.name}"
        )


def demo_settings(out_dir: Path) -> Settings:
    """Fast failure detection (so the kill fault recovers in seconds) and checksums on."""
    return load_settings(
        trace_enabled=True, trace_dir=str(out_dir / "traces"), checksum=True,
        heartbeat_interval=0.5, heartbeat_max_failure=2, waiting_timeout=30.0,
        bootstrap_timeout=30.0,
    )  # fmt: skip


async def run_demo(options: DemoOptions, on_progress: Callable[[int], None],
                   notes: Callable[[str], None]) -> DemoReport:  # fmt: skip
    import torch

    torch.set_num_threads(1)  # two instances share two cores; keep torch from oversubscribing
    out_dir = Path(options.out_dir)
    (out_dir / "traces").mkdir(parents=True, exist_ok=True)
    for old in (out_dir / "traces").glob("*.jsonl*"):
        old.unlink()
    settings = demo_settings(out_dir)
    model = TinyTransformer(ModelConfig(seed=options.seed))
    geometry = model.config.kv_geometry()
    prompts = make_prompts(options.seed, options.requests, options.prompt_len)
    references = [generate_reference(model, p, options.max_new) for p in prompts]
    room_pages = geometry.pages_for(options.prompt_len + options.max_new) + 1
    pool = room_pages * options.concurrency * 4
    prefill_caches = [PagedKVCache(geometry, pool, tp_rank=r, tp_size=2) for r in range(2)]
    decode_cache = PagedKVCache(geometry, pool, tp_rank=0, tp_size=1)
    page_bytes = decode_cache.bytes_per_page * 2 * geometry.n_layers
    transports = TransportFactory(options.transport)
    notes(f"transport: {transports.kind}"
          + (" (Mooncake Transfer Engine over TCP)" if transports.kind == "mooncake" else ""))
    started = time.perf_counter()
    records = [RequestRecord(i, 0) for i in range(options.requests)]
    async with (
        decode_instance(model, decode_cache, settings, transports,
                        staging_bytes=page_bytes * pool) as decode,
        anyio.create_task_group() as tasks,
    ):  # fmt: skip
        bootstrap = f"{settings.host}:0"

        def start_prefill() -> PrefillInstance:
            instance = PrefillInstance(model, prefill_caches, settings, transports, bootstrap,
                                       staging_slot_bytes=page_bytes * 4)  # fmt: skip
            tasks.start_soon(instance.run)
            return instance

        router = Router(options, decode, start_prefill, notes)
        router.prefill = start_prefill()
        await router.prefill.ready.wait()
        bootstrap = router.prefill.bootstrap
        notes(f"bootstrap registry: http://{bootstrap} (served by the prefill, incarnation "
              f"{router.prefill.incarnation})")
        for record in records:
            record.room = router.room_base + record.index
            record.expected = references[record.index]
        await _run_all(router, records, prompts, options, on_progress, notes)
        await _settle(decode, router.stopped_incarnations)
        snapshot = decode.node.ranks[0].snapshot()
        free_in_engine = decode_cache.allocator.num_free
        held_for_dead = _held_for_dead_writers(decode, router.stopped_incarnations)
        tasks.cancel_scope.cancel()
    report = _report(options, transports.kind, router, records, snapshot, free_in_engine,
                     held_for_dead, out_dir, time.perf_counter() - started)
    report.timeline = _timeline_page(report.traces, out_dir / "timeline.html")
    return report


def _timeline_page(traces: list[str], out: Path) -> str | None:
    """The swimlane page of every room of this run (the same as `pdflow trace show --html`)."""
    from pdflow.trace.merge import load_traces
    from pdflow.trace.timeline import build_timelines
    from pdflow.trace.timeline_html import write_html

    if not traces:
        return None
    trace = load_traces([Path(p) for p in traces])
    timelines = build_timelines(trace)
    write_html(out, timelines, list(trace.headers), "pdflow demo", None)
    return str(out)


async def _run_all(router: Router, records: list[RequestRecord], prompts: list[list[int]],
                   options: DemoOptions, on_progress: Callable[[int], None],
                   notes: Callable[[str], None]) -> None:  # fmt: skip
    limiter = anyio.Semaphore(options.concurrency)
    finished = 0

    async def one(record: RequestRecord) -> None:
        nonlocal finished
        async with limiter:
            await router.run_request(record, prompts[record.index])
        finished += 1
        on_progress(finished)

    async with anyio.create_task_group() as tasks:
        def spawn(job: Callable[[], Awaitable[None]]) -> None:
            async def run_job() -> None:
                await job()

            tasks.start_soon(run_job)

        router.spawn = spawn
        for record in records:
            tasks.start_soon(one, record)


def _held_for_dead_writers(decode: DecodeEngine, stopped: set[str]) -> int:
    """Quarantined pages that only a stopped prefill could free, where nothing can fence it."""
    if decode.node.transport.fence_is_real:
        return 0
    return sum(len(room.pages) for room in decode.node.ranks[0].quarantine()
               if all(w.incarnation in stopped for w in room.waiting_on))  # fmt: skip


async def _settle(decode: DecodeEngine, stopped: set[str], timeout_s: float = 15.0) -> None:
    """Wait until every fenced page came back to the ledger *and* the engine has taken the
    matching PagesReleased events (they arrive on a stream); the report then shows what is left,
    and the demo fails loudly if a page never came back."""
    rank = decode.node.ranks[0]
    with anyio.move_on_after(timeout_s):
        while True:
            snapshot = rank.snapshot()
            ledger = snapshot.ledger
            held = _held_for_dead_writers(decode, stopped)
            engine_whole = decode.cache.allocator.num_free + held == decode.cache.num_pages
            if ledger.free + held == ledger.pool_size and not snapshot.rooms and engine_whole:
                return
            await anyio.sleep(0.05)


def _report(options: DemoOptions, transport: str, router: Router,
            records: list[RequestRecord], snapshot: object, free_in_engine: int,
            held_for_dead: int, out_dir: Path, wall_s: float) -> DemoReport:  # fmt: skip
    from pdflow.core.endpoints.decode_endpoint import DecodeSnapshot

    assert isinstance(snapshot, DecodeSnapshot)
    ledger = snapshot.ledger
    done = [r for r in records if r.ok]
    moved = sum(r.kv_bytes for r in done)
    transfer = sum(r.transfer_s or 0.0 for r in done)
    handshakes = [r.handshake_s * 1e3 for r in done if r.handshake_s is not None]
    ttfts = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    leaked = (ledger.pool_size - ledger.free - ledger.quarantined) + (
        ledger.pool_size - free_in_engine - ledger.quarantined
    )
    return DemoReport(
        transport=transport,
        requests=len(records),
        succeeded=len(done),
        tokens_equal=all(r.ok and r.tokens == r.expected for r in records),
        attempts=sum(r.attempts for r in records),
        tokens_generated=sum(len(r.tokens) for r in done),
        bytes_moved=moved,
        transfer_gbps=moved / transfer / 1e9 if transfer else None,
        handshake_ms_p50=percentile(handshakes, 0.5),
        handshake_ms_p99=percentile(handshakes, 0.99),
        ttft_ms_p50=percentile(ttfts, 0.5),
        ttft_ms_p99=percentile(ttfts, 0.99),
        pages_quarantined=ledger.quarantined,
        pages_held_for_dead_writers=held_for_dead,
        pages_leaked=leaked,
        faults=router.faults,
        traces=sorted(str(p) for p in (out_dir / "traces").glob("*.jsonl")),
        wall_s=wall_s,
        records=records,
    )
