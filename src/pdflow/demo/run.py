"""`pdflow demo`: a real prefill (TP=2) and decode (TP=1) on loopback, driven by a small router.

For each request the router picks a bootstrap room and a generation, starts the decode (which
reserves pages and publishes them through pdflow) and the prefill (which computes the prompt's
KV with the tiny model and sends it, staged, through pdflow, with the first token in the
request's aux row, which pdflow lands in the decode's aux slot: the router only routes), and checks
that the decode's tokens equal a single-process run of the same model. A failed attempt is
retried on the same room id with the next generation, so room reuse is exercised too.

With faults, both injected failures land inside a transfer: the prefill's link (link.py) holds
the faulted attempt's first write, then the decode aborts the room, or the prefill instance is
stopped with half of that write landed and the rest never sent.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.demo.engines import DecodeEngine, RoomOutcome
from pdflow.demo.instances import (
    PendingResult,
    PrefillInstance,
    TransportFactory,
    decode_instance,
    mooncake_problem,
)
from pdflow.demo.kvcache import PagedKVCache
from pdflow.demo.limits import SEED_LIMIT, UPPER_BOUNDS
from pdflow.demo.link import HeldWrite, PrefillLink
from pdflow.demo.model import ModelConfig, TinyTransformer, generate_reference, make_prompts
from pdflow.io.settings import Settings, load_settings

MAX_ATTEMPTS = 5
RETRY_BACKOFF_S = 0.25
"""A retry waits attempt x this: long enough for the decode's heartbeat to notice a prefill that
died or restarted (two probes at 0.5 s in the demo), so the next attempt meets the new life."""

POOL_BYTES_LIMIT = 1 << 30
"""Host memory the KV pools may take (decode cache, prefill shards, decode staging)."""
POOL_ROOMS_PER_SLOT = 4
"""Pool pages per request in flight, in rooms: in flight, held by a stopped prefill, spare."""


class DemoOptions(msgspec.Struct, frozen=True):
    requests: int = 12
    prompt_len: int = 40
    max_new: int = 12
    """Tokens generated per request, the prefill's first token included."""
    concurrency: int = 4
    transport: str = "auto"
    faults: bool = False
    seed: int = 0
    out_dir: str = "out/demo"


def room_pages(options: DemoOptions, page_size: int) -> int:
    """Pages one request may use on the decode: its prompt and generated tokens, plus one."""
    return -(-(options.prompt_len + options.max_new) // page_size) + 1


def check_options(options: DemoOptions) -> str | None:
    """Why these options cannot run (one line naming the option and what to do), or None.
    Checked before anything starts, so bad input never ends in a traceback."""
    for name, top in UPPER_BOUNDS.items():
        value = getattr(options, name)
        flag = "--" + name.replace("_", "-")
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
        if value > top:
            return f"{flag} must be at most {top:,}, got {value:,}"
    if not 0 <= options.seed < SEED_LIMIT:
        return f"--seed must be from 0 to 2**63-1, got {options.seed}"
    config = ModelConfig()
    page_bytes = config.page_size * config.n_kv_heads * config.head_dim * 4 * 2 * config.n_layers
    pool = room_pages(options, config.page_size) * options.concurrency * POOL_ROOMS_PER_SLOT
    pool_bytes = 3 * pool * page_bytes
    if pool_bytes > POOL_BYTES_LIMIT:
        return (f"--concurrency {options.concurrency} with --prompt-len {options.prompt_len} and "
                f"--max-new {options.max_new} needs {pool_bytes / 2**30:.1f} GiB of KV pools "
                f"(at most {POOL_BYTES_LIMIT / 2**30:.0f} GiB); lower one of them")  # fmt: skip
    if options.transport == "mooncake":
        problem = mooncake_problem()
        if problem is not None:
            return (f"--transport mooncake: the Mooncake Transfer Engine cannot be imported "
                    f"({problem}); install pdflow[mooncake] or use --transport inprocess")
    return _check_out_dir(Path(options.out_dir))


def _check_out_dir(out_dir: Path) -> str | None:
    try:
        (out_dir / "traces").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir / "traces"):
            pass
    except OSError as exc:
        return (f"--out {out_dir}: cannot write there ({exc.strerror or exc}); "
                "name a writable directory")
    return None


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
    bytes_moved: int = 0
    """What the prefill wrote for the successful attempt: KV pages and model state."""


class InjectedFault(msgspec.Struct):
    """A fault the demo injected, and where it landed: a room attempt with a write in flight
    (held in the prefill's link) when the fault struck."""

    kind: str
    """"decode_abort" or "prefill_stop"."""
    request: int
    room: int
    generation: int
    held_bytes: int
    """Bytes of that write still in flight (never sent, for a stopped prefill)."""
    landed_bytes: int = 0
    """Bytes of that write that had landed in the decode before the prefill stopped."""
    incarnation: str = ""
    """The stopped prefill instance."""


class DemoReport(msgspec.Struct, kw_only=True):
    transport: str
    requests: int
    succeeded: int
    tokens_equal: bool
    attempts: int
    tokens_generated: int
    bytes_moved: int
    """Bytes the prefill wrote for the successful requests: ``kv_bytes + state_bytes``."""
    kv_bytes: int
    """Of those, KV pages: every successful request's prompt pages, all heads and layers."""
    state_bytes: int
    """Of those, model state (the recurrent memory vectors)."""
    transfer_gbps: float | None
    """Every write that landed (any attempt), over the time at least one was in flight."""
    transport_busy_s: float
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
    injected: list[InjectedFault]
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
                 start_prefill: Callable[[], PrefillInstance], link: PrefillLink,
                 notes: Callable[[str], None]) -> None:  # fmt: skip
        self.options = options
        self.decode = decode
        self.start_prefill = start_prefill
        self.prefill: PrefillInstance | None = None
        self.link = link
        self.notes = notes
        self.rng = random.Random(options.seed)
        # Rooms are random 63-bit integers in production; small distinct ones read better here.
        self.room_base = self.rng.randrange(1_000, 9_000) * 100
        self.aborts = set(self.rng.sample(range(options.requests),
                                          k=max(1, options.requests // 5)))  # fmt: skip
        # The prefill is stopped inside one of this request's writes.
        self.kill_request = options.requests // 2 if options.faults else None
        if self.kill_request is not None:
            self.aborts.discard(self.kill_request)
        self.faults: list[str] = []
        self.injected: list[InjectedFault] = []
        self.stopped_incarnations: set[str] = set()

    async def run_request(self, record: RequestRecord, prompt: list[int]) -> None:
        for attempt in range(MAX_ATTEMPTS):
            record.attempts += 1
            outcome = await self._attempt(record, prompt, attempt)
            if outcome is None:
                return
            record.failures.append(outcome)
            if attempt + 1 < MAX_ATTEMPTS:
                await anyio.sleep(RETRY_BACKOFF_S * (attempt + 1))
        record.ok = False

    def fault(self, text: str) -> None:
        self.faults.append(text)

    async def _stop_prefill_inside(self, old: PrefillInstance, hold: HeldWrite,
                                   record: RequestRecord) -> None:  # fmt: skip
        await hold.reached.wait()
        if self.prefill is not old:
            return
        self.kill_request = None
        self.prefill = None  # new attempts wait for the next life of the prefill
        old.kill()
        await old.stopped.wait()  # its sockets are closed: the address can be served again
        self.stopped_incarnations.add(old.incarnation)
        self.injected.append(InjectedFault("prefill_stop", record.index, hold.room,
                                           hold.generation, hold.held_bytes, hold.landed_bytes,
                                           old.incarnation))  # fmt: skip
        held = ("freed once the decode fenced the dead writer on its receiving side"
                if self.decode.node.transport.fence_is_real else
                "held for good: Mooncake TCP cannot fence a writer on the receiving side and "
                "a stopped writer never sends its drain ACK")  # fmt: skip
        self.fault(f"prefill instance {old.incarnation} stopped abruptly inside one of request "
                   f"{record.index}'s writes (room {hold.room} generation "
                   f"{hold.generation}: {hold.landed_bytes} B landed, {hold.held_bytes} B never "
                   "sent); the decode failed the rooms it had with it (heartbeat or incarnation "
                   f"change) and quarantined their pages, {held}")  # fmt: skip
        self.prefill = self.start_prefill()
        await self.prefill.ready.wait()
        self.fault(f"prefill restarted as incarnation {self.prefill.incarnation} on the same "
                   "bootstrap address; the decode kept running and served the retries")
        self.notes(self.faults[-1])

    async def _attempt(self, record: RequestRecord, prompt: list[int],
                       generation: int) -> str | None:  # fmt: skip
        """One try; None on success, else why it failed."""
        while self.prefill is None or not self.prefill.ready.is_set():
            await anyio.sleep(0.05)
        prefill = self.prefill
        # A fault stays pending until it lands inside a write: an attempt that ended before
        # its first write (its prefill stopped under it, say) passes it to the next attempt.
        abort_hold = stop_hold = None
        if self.options.faults and record.index in self.aborts:
            abort_hold = self.link.arm(record.room, generation)
        if record.index == self.kill_request:
            stop_hold = self.link.arm(record.room, generation, tear=True)
        try:
            async with anyio.create_task_group() as faults:
                if stop_hold is not None:
                    faults.start_soon(self._stop_prefill_inside, prefill, stop_hold, record)
                decoded, sent, result = await self._pair(record, prompt, generation, prefill,
                                                         abort_hold)  # fmt: skip
                if stop_hold is not None and not stop_hold.reached.is_set():
                    faults.cancel_scope.cancel()  # the attempt ended before its first write
        finally:
            for hold in (abort_hold, stop_hold):
                if hold is not None:
                    self.link.disarm(hold)
        if abort_hold is not None:
            self._note_abort(record, abort_hold, decoded)
        # The decode verified the KV (checksums) and generated; the prefill's transfer had
        # completed, so a prefill stopped while only clearing the room does not undo it.
        transferred = sent if sent.poll is KVPoll.Success else result.transferred
        if decoded.poll is KVPoll.Success and transferred is not None:
            record.ok = True
            record.tokens = decoded.tokens
            record.ttft_s = decoded.ttft_s
            record.handshake_s = decoded.handshake_s
            record.transfer_s = transferred.transfer_s
            record.bytes_moved = transferred.bytes_written
            return None
        return (
            f"generation {generation}: decode {decoded.reason or decoded.poll.name}; "
            f"prefill {sent.reason or sent.poll.name}"
        )

    async def _pair(self, record: RequestRecord, prompt: list[int], generation: int,
                    prefill: PrefillInstance, abort_hold: HeldWrite | None,
                    ) -> tuple[RoomOutcome, RoomOutcome, PendingResult]:  # fmt: skip
        """Run the room on both instances; a side that fails tells the other at once."""
        result = prefill.submit(record.room, generation, prompt)
        decode_done = False

        async def pass_on_prefill_failure() -> None:
            sent = await result.get()
            # A stopped instance told nobody: the decode must notice it by itself.
            if sent.poll is KVPoll.Failed and not sent.stopped and not decode_done:
                await self.decode.fail(record.room, generation,
                                       f"the prefill failed: {sent.reason}")  # fmt: skip

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(pass_on_prefill_failure)
            decoded = await self.decode.serve(
                record.room, generation, prefill.bootstrap, len(prompt), self.options.max_new,
                abort_when=None if abort_hold is None else abort_hold.reached,
            )
            decode_done = True
            if abort_hold is not None:
                abort_hold.release.set()  # the held write goes on, into the aborted room
            if decoded.poll is KVPoll.Failed and not result.done.is_set():
                # The decode side gave up: do not let the prefill wait out its bootstrap timer.
                await prefill.abort(record.room, f"the decode failed: {decoded.reason}")
        return decoded, await result.get(), result

    def _note_abort(self, record: RequestRecord, hold: HeldWrite, decoded: RoomOutcome) -> None:
        """Count the abort if it landed inside the write; else it stays pending."""
        if hold.reached.is_set() and "demo fault" in decoded.reason:
            self.aborts.discard(record.index)
            self.injected.append(InjectedFault("decode_abort", record.index, hold.room,
                                               hold.generation, hold.held_bytes))  # fmt: skip
            self.fault(f"request {record.index}: the decode aborted room {hold.room} generation "
                       f"{hold.generation} while one of the prefill's writes for it "
                       f"({hold.held_bytes} B) was in flight; the write then landed in the "
                       "room's quarantined pages, freed by the prefill's drain ACK; retried as "
                       f"generation {hold.generation + 1}")  # fmt: skip


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
    references = []
    for prompt in prompts:
        # max_new tokens in all: the prefill's first one, then max_new - 1 decode steps.
        references.append(generate_reference(model, prompt, options.max_new - 1))
        await anyio.lowlevel.checkpoint()  # a Ctrl-C lands between references, not after all
    pool = room_pages(options, geometry.page_size) * options.concurrency * POOL_ROOMS_PER_SLOT
    prefill_caches = [PagedKVCache(geometry, pool, tp_rank=r, tp_size=2) for r in range(2)]
    decode_cache = PagedKVCache(geometry, pool, tp_rank=0, tp_size=1)
    page_bytes = decode_cache.bytes_per_page * 2 * geometry.n_layers
    transports = TransportFactory(options.transport)
    link = PrefillLink()
    notes(f"transport: {transports.kind}"
          + (" (Mooncake Transfer Engine over TCP)" if transports.kind == "mooncake" else ""))
    started = time.perf_counter()
    records = [RequestRecord(i, 0) for i in range(options.requests)]
    async with (
        decode_instance(model, decode_cache, settings, transports,
                        staging_bytes=page_bytes * pool, rows=options.concurrency) as decode,
        anyio.create_task_group() as tasks,
    ):  # fmt: skip
        bootstrap = f"{settings.host}:0"

        def start_prefill() -> PrefillInstance:
            instance = PrefillInstance(model, prefill_caches, settings, transports, bootstrap,
                                       staging_slot_bytes=page_bytes * 4, link=link,
                                       rows=options.concurrency)  # fmt: skip
            tasks.start_soon(instance.run)
            return instance

        router = Router(options, decode, start_prefill, link, notes)
        router.prefill = start_prefill()
        await router.prefill.ready.wait()
        bootstrap = router.prefill.bootstrap
        notes(f"bootstrap registry: http://{bootstrap} (served by the prefill, incarnation "
              f"{router.prefill.incarnation})")
        for record in records:
            record.room = router.room_base + record.index
            record.expected = references[record.index]
        await _run_all(router, records, prompts, options, on_progress)
        await _settle(decode, router.stopped_incarnations)
        snapshot = decode.node.ranks[0].snapshot()
        free_in_engine = decode_cache.allocator.num_free
        held_for_dead = _held_for_dead_writers(decode, router.stopped_incarnations)
        tasks.cancel_scope.cancel()
    room_kv_bytes = geometry.pages_for(options.prompt_len) * page_bytes
    report = _report(transports.kind, router, records, snapshot, free_in_engine, held_for_dead,
                     room_kv_bytes, out_dir, time.perf_counter() - started)  # fmt: skip
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
                   options: DemoOptions, on_progress: Callable[[int], None]) -> None:
    limiter = anyio.Semaphore(options.concurrency)
    finished = 0

    async def one(record: RequestRecord) -> None:
        nonlocal finished
        async with limiter:
            await router.run_request(record, prompts[record.index])
        finished += 1
        on_progress(finished)

    async with anyio.create_task_group() as tasks:
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


def _report(transport: str, router: Router, records: list[RequestRecord], snapshot: object,
            free_in_engine: int, held_for_dead: int, room_kv_bytes: int, out_dir: Path,
            wall_s: float) -> DemoReport:  # fmt: skip
    from pdflow.core.endpoints.decode_endpoint import DecodeSnapshot

    assert isinstance(snapshot, DecodeSnapshot)
    ledger = snapshot.ledger
    done = [r for r in records if r.ok]
    moved = sum(r.bytes_moved for r in done)
    kv = room_kv_bytes * len(done)
    busy_s = router.link.busy_seconds()
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
        kv_bytes=kv,
        state_bytes=moved - kv,
        transfer_gbps=router.link.bytes_written() / busy_s / 1e9 if busy_s else None,
        transport_busy_s=busy_s,
        handshake_ms_p50=percentile(handshakes, 0.5),
        handshake_ms_p99=percentile(handshakes, 0.99),
        ttft_ms_p50=percentile(ttfts, 0.5),
        ttft_ms_p99=percentile(ttfts, 0.99),
        pages_quarantined=ledger.quarantined,
        pages_held_for_dead_writers=held_for_dead,
        pages_leaked=leaked,
        faults=router.faults,
        injected=router.injected,
        traces=sorted(str(p) for p in (out_dir / "traces").glob("*.jsonl")),
        wall_s=wall_s,
        records=records,
    )
