"""Test harness for nodes: a prefill subprocess driven over stdin, and an in-test decode engine
that allocates pages only from what the node released, checks every byte it received, and keeps
canary bytes in every free page to catch a write landing after a release."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import HostKvCache, RankKv, host_cache_for_rank
from pdflow.io.node_common import NodeEvent, PagesHeld, PagesReleased, RoomStatus, WriterFenced
from pdflow.io.node_decode import DecodeNode, DecodeRank
from pdflow.io.node_prefill import PrefillNode, PrefillRank
from pdflow.io.settings import Settings, load_settings
from pdflow.transport import InProcessFabric
from pdflow.transport.base import Transport
from pdflow.transport.mooncake import MooncakeTransport

sys.path.insert(0, os.path.dirname(__file__))
from canaries import Canaries
from node_kv_pattern import GEOMETRY, matches, pages_for

PREFILL_SCRIPT = Path(__file__).with_name("node_prefill_proc.py")


class PrefillProcess:
    """The prefill subprocess: send commands, collect its JSON events."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self._reader = BufferedByteReceiveStream(process.stdout)  # type: ignore[arg-type]
        self.ready: dict[str, Any] = {}
        self.rooms: dict[int, list[str]] = {}
        self.room_done: dict[int, anyio.Event] = {}
        self.counts: Counter[str] = Counter()

    async def read_event(self) -> dict[str, Any]:
        line = await self._reader.receive_until(b"\n", 1 << 20)
        event: dict[str, Any] = json.loads(line)
        return event

    async def pump(self) -> None:
        while True:
            try:
                event = await self.read_event()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                return
            self.counts[event["event"]] += 1
            if event["event"] == "room":
                self.rooms[event["room"]] = event["results"]
                self.room_done.setdefault(event["room"], anyio.Event()).set()

    async def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send((json.dumps(command) + "\n").encode())

    async def start_room(
        self, room: int, generation: int, tokens: int, stall: bool = False,
        fill_byte: int | None = None,
    ) -> None:
        """``fill_byte``: the room's pages hold that byte, not the room's pattern (a room of
        many MiB whose bytes no decode checks, filled without computing its pattern)."""
        self.room_done.setdefault(room, anyio.Event())
        await self.send(op="room", room=room, generation=generation, tokens=tokens, stall=stall,
                        fill_byte=fill_byte)  # fmt: skip

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)


@asynccontextmanager
async def prefill_process(
    tasks: TaskGroup, options: dict[str, Any], script: Path = PREFILL_SCRIPT
) -> AsyncIterator[PrefillProcess]:
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
    process = await anyio.open_process(
        [sys.executable, str(script), json.dumps(options)], env=env, stderr=None
    )
    handle = PrefillProcess(process)
    try:
        with anyio.fail_after(30):
            handle.ready = await handle.read_event()
        assert handle.ready["event"] == "ready", handle.ready
        tasks.start_soon(handle.pump)
        yield handle
    finally:
        # Shielded: tests often cancel the task group from inside this block, and an unshielded
        # cleanup was cancelled at its first await, leaving the prefill process running.
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                try:
                    await handle.send(op="quit")
                    with anyio.fail_after(10):
                        await process.wait()
                except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError,
                        OSError):  # fmt: skip
                    process.kill()
                    await process.wait()
            await process.aclose()


class DecodeEngine:
    """A minimal decode engine: one free list per rank fed only by PagesReleased events."""

    def __init__(self, node: DecodeNode, caches: list[HostKvCache]) -> None:
        self.node = node
        self.caches = caches
        self.free = [list(range(kv.layout.num_pages)) for kv in node.rank_kv]
        self.in_use: list[set[int]] = [set() for _ in node.rank_kv]
        self.freed = [anyio.Event() for _ in node.rank_kv]
        self.events: list[NodeEvent] = []
        self.quarantined: set[tuple[int, int, int]] = set()  # (rank, room, generation)
        self.verified = 0
        self.corrupt: list[int] = []
        self.canaries = [Canaries(kv.layout) for kv in node.rank_kv]
        for canaries in self.canaries:
            canaries.fill(range(canaries.layout.num_pages))
        self.landed_while_held: list[tuple[int, int]] = []  # (rank, page)

    async def pump(self) -> None:
        async with self.node.subscribe() as stream:
            async for event in stream:
                self.events.append(event)
                if isinstance(event, PagesHeld):
                    self.quarantined.add((event.rank, event.room, event.generation))
                if isinstance(event, PagesReleased):
                    index = self._index(event.rank)
                    assert self.in_use[index].issuperset(event.pages), event
                    # What a quarantined room's late writes landed until now landed in a page
                    # still held; from here on the canary must stay until it is handed out.
                    if (event.rank, event.room, event.generation) in self.quarantined:
                        damaged = self.canaries[index].damaged(event.pages)
                        self.landed_while_held += [(event.rank, page) for page in damaged]
                    self.canaries[index].fill(event.pages)
                    self.in_use[index].difference_update(event.pages)
                    self.free[index].extend(event.pages)
                    self.freed[index].set()

    def _index(self, rank: int) -> int:
        return [kv.tp_rank for kv in self.node.rank_kv].index(rank)

    def take_run(self, index: int, count: int) -> list[int]:
        """``count`` consecutive free pages of one rank, now: a prefill writing consecutive
        source pages moves them in one write op per buffer."""
        free = set(self.free[index])
        start = next((page for page in sorted(free)
                      if all(page + i in free for i in range(count))), None)  # fmt: skip
        if start is None:
            raise LookupError(f"no run of {count} free pages on rank index {index}")
        run = list(range(start, start + count))
        self.free[index] = [page for page in self.free[index] if page not in set(run)]
        self.in_use[index].update(run)
        return run

    async def take(self, indices: list[int], count: int) -> dict[int, list[int]]:
        """``count`` pages on each rank at once: holding one rank's pages while waiting for
        another's would deadlock two rooms against each other."""
        while any(len(self.free[index]) < count for index in indices):
            short = next(i for i in indices if len(self.free[i]) < count)
            if self.freed[short].is_set():
                self.freed[short] = anyio.Event()
            await self.freed[short].wait()
        taken = {}
        for index in indices:
            random.shuffle(self.free[index])
            taken[index], self.free[index] = self.free[index][:count], self.free[index][count:]
            self.in_use[index].update(taken[index])
        return taken

    async def run_room(self, bootstrap: str, room: int, generation: int, tokens: int,
                       abort_after: float | None = None) -> str:  # fmt: skip
        """Receive one room on every rank; returns the outcome ("Success"/"Failed")."""
        ranks = self.node.ranks
        for rank in ranks:
            await rank.open(room, generation, bootstrap)
        outcomes: list[KVPoll] = []
        ready = [(await rank.wait(room)).poll is not KVPoll.Failed for rank in ranks]
        held = await self.take([i for i, ok in enumerate(ready) if ok], pages_for(tokens))

        async def one(index: int) -> None:
            rank = ranks[index]
            if index in held:
                await rank.publish_pages(room, held[index])
            if abort_after is not None:
                await anyio.sleep(abort_after)
                await rank.abort(room, "abort storm")
            outcomes.append((await rank.wait(room, terminal=True)).poll)

        async with anyio.create_task_group() as group:
            for index in range(len(ranks)):
                group.start_soon(one, index)
        success = all(poll is KVPoll.Success for poll in outcomes)
        if success:
            for index, pages in held.items():
                kv: RankKv = self.node.rank_kv[index]
                if matches(self.caches[index], kv, room, pages):
                    self.verified += 1
                else:
                    self.corrupt.append(room)
        for rank in ranks:
            await rank.clear(room)
        return "Success" if success else "Failed"

    def written_after_release(self) -> list[tuple[int, int]]:
        """(rank, page) of every free page whose canary a write has changed."""
        return [(kv.tp_rank, page) for index, kv in enumerate(self.node.rank_kv)
                for page in self.canaries[index].damaged(self.free[index])]  # fmt: skip

    def leak_report(self) -> list[str]:
        problems = []
        for index, rank in enumerate(self.node.ranks):
            pool = rank.kv.layout.num_pages
            if rank.allocatable != pool:
                problems.append(f"rank {rank.rank}: ledger has {rank.allocatable}/{pool} free")
            if sorted(self.free[index]) != list(range(pool)):
                problems.append(f"rank {rank.rank}: engine free list has {len(self.free[index])}")
        return problems

    async def settled_leak_report(self, within: float = 5.0) -> list[str]:
        """The leak report once the engine has taken the PagesReleased events already sent.

        The node frees pages in its ledger before its event stream hands the news to this
        engine, so a report taken at once can count pages that are merely in transit. A page
        really lost stays missing after the bounded wait.
        """
        with anyio.move_on_after(within):
            while self.leak_report():
                await anyio.sleep(0.02)
        return self.leak_report()

    def order_of(self, kind: type, **match: Any) -> list[int]:
        return [i for i, e in enumerate(self.events) if isinstance(e, kind)
                and all(getattr(e, k) == v for k, v in match.items())]  # fmt: skip


def start_rooms(
    group: TaskGroup, engine: DecodeEngine, prefill: PrefillProcess, bootstrap: str,
    rooms: range, tokens: int = 64, stall: bool = False,
) -> dict[int, str]:
    """Start each of ``rooms`` (generation 0, ``tokens`` long) on the prefill and run it on the
    decode engine, each in its own task of ``group``. Returns the dict that gets each room's
    outcome as it ends."""
    outcomes: dict[int, str] = {}

    async def one(room: int) -> None:
        await prefill.start_room(room, 0, tokens, stall=stall)
        outcomes[room] = await engine.run_room(bootstrap, room, 0, tokens)

    for room in rooms:
        group.start_soon(one, room)
    return outcomes


async def stall_then_kill(
    engine: DecodeEngine, prefill: PrefillProcess, bootstrap: str, rooms: range, tokens: int = 128
) -> tuple[dict[int, str], float]:
    """Run ``rooms`` whose prefill writes only their first chunk; once every decode rank reports
    each of them Transferring, kill -9 the prefill. Returns each room's outcome, once every room
    ended, and the monotonic time of the kill."""
    transferring = len(rooms) * len(engine.node.ranks)
    async with anyio.create_task_group() as group:
        outcomes = start_rooms(group, engine, prefill, bootstrap, rooms, tokens, stall=True)
        with anyio.fail_after(10):
            while sum(isinstance(e, RoomStatus) and e.room in rooms
                      and e.poll is KVPoll.Transferring for e in engine.events) < transferring:
                await anyio.sleep(0.01)
        prefill.kill()
        killed_at = time.monotonic()
    return outcomes, killed_at


async def wait_readmitted(node: DecodeNode, timeout_s: float = 10) -> None:
    """Until every decode rank readmitted the prefill it wrongly declared dead (at its first
    answered probe once it ACKed its ABORTs): rooms opened before that fail with that reason."""
    with anyio.fail_after(timeout_s):
        while not all(r.snapshot().counters.get("prefill_instances_readmitted")
                      for r in node.ranks):  # fmt: skip
            await anyio.sleep(0.02)


@asynccontextmanager
async def decode_engine(
    tasks: TaskGroup, transport: Transport, settings: dict[str, Any], *, tp: int = 2,
    num_pages: int = 256, head_dim: int = GEOMETRY["head_dim"],
) -> AsyncIterator[DecodeEngine]:
    """A DecodeNode of ``tp`` ranks over host caches of ``num_pages`` pages each, and the
    engine that drives it, pumping its events in ``tasks`` (the node is ``engine.node``)."""
    caches = decode_caches(tp, num_pages=num_pages, head_dim=head_dim)
    async with DecodeNode(ranks=[kv for _, kv in caches], transport=transport,
                          settings=load_settings(**settings)) as node:  # fmt: skip
        engine = DecodeEngine(node, [cache for cache, _ in caches])
        tasks.start_soon(engine.pump)
        yield engine


@dataclass
class SigstoppedPrefill:
    """What :func:`sigstopped_prefill` leaves: the decode engine, the paused prefill, its
    bootstrap, each held room's outcome and the monotonic time of the SIGSTOP."""

    engine: DecodeEngine
    prefill: PrefillProcess
    bootstrap: str
    outcomes: dict[int, str]
    stopped_at: float


@asynccontextmanager
async def sigstopped_prefill(
    settings: dict[str, Any], rooms: range
) -> AsyncIterator[SigstoppedPrefill]:
    """Over Mooncake TCP, a decode engine (2 ranks of 256 pages) and a prefill process started
    with ``gate_writes``: three warm rooms succeed; then the prefill holds its writes, ``rooms``
    run until every chunk was handed to its transport and held, and the prefill is paused
    (SIGSTOP) with those writes in flight. Yields once the heartbeat failed every one of
    ``rooms``; afterwards stops everything it started."""
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, num_pages=256) as engine:
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512,
                       "gate_writes": True}  # fmt: skip
            async with prefill_process(tasks, options) as prefill:
                bootstrap = prefill.ready["bootstrap"]
                for room in range(3):
                    await prefill.start_room(room, 0, 64)
                    assert await engine.run_room(bootstrap, room, 0, 64) == "Success"
                await prefill.send(op="hold_writes")
                async with anyio.create_task_group() as group:
                    outcomes = start_rooms(group, engine, prefill, bootstrap, rooms)
                    # Every chunk handed to the transport, and its writes held: send_chunk
                    # returns before a transfer worker takes the chunk (the endpoint lock does
                    # not yield), so chunks_sent alone can come before the first write_held.
                    with anyio.fail_after(10):
                        while (prefill.counts["chunks_sent"] < 2 * len(rooms)
                               or prefill.counts["write_held"] == 0):  # fmt: skip
                            await anyio.sleep(0.01)
                    prefill.process.send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
                assert set(outcomes.values()) == {"Failed"}, outcomes
                yield SigstoppedPrefill(engine, prefill, bootstrap, outcomes, stopped_at)
        tasks.cancel_scope.cancel()


@asynccontextmanager
async def inprocess_nodes(
    p_kv: list[RankKv], d_kv: list[RankKv], settings: Settings,
    fabric: InProcessFabric | None = None,
) -> AsyncIterator[tuple[PrefillNode, DecodeNode]]:  # fmt: skip
    """A prefill node and a decode node over one in-process fabric (the prefill hosts the
    registry): ``fabric`` when the test holds writes or picks the fence, else a new one."""
    fabric = fabric if fabric is not None else InProcessFabric()
    async with (
        fabric.create_transport() as p_transport,
        fabric.create_transport() as d_transport,
        PrefillNode(ranks=p_kv, transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings) as p_node,
        DecodeNode(ranks=d_kv, transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        yield p_node, d_node


@asynccontextmanager
async def inprocess_room(
    p_kv: RankKv, d_kv: RankKv, settings: Settings, room: int = 1
) -> AsyncIterator[tuple[PrefillRank, DecodeRank]]:
    """:func:`inprocess_nodes` of one rank each, with ``room`` (generation 0) opened on both
    and its bootstrap done: the decode may publish."""
    async with inprocess_nodes([p_kv], [d_kv], settings) as (p_node, d_node):
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        await p_rank.open_room(room, 0)
        await d_rank.open(room, 0, p_node.bootstrap)
        await d_rank.wait(room)
        yield p_rank, d_rank




def decode_caches(tp: int, num_pages: int,
                  head_dim: int = GEOMETRY["head_dim"]) -> list[tuple[HostKvCache, RankKv]]:
    """``head_dim`` sets the page size in bytes (a prefill must be started with the same)."""
    geometry = {**GEOMETRY, "head_dim": head_dim}
    return [host_cache_for_rank(tp_size=tp, tp_rank=r, num_pages=num_pages, dtype=KvDtype.FP16,
                                **geometry) for r in range(tp)]  # fmt: skip


__all__ = ["DecodeEngine", "PagesHeld", "PrefillProcess", "Settings", "WriterFenced",
           "decode_caches", "prefill_process"]  # fmt: skip
