"""A chaos decode instance: a DecodeNode over Mooncake TCP and an engine that keeps canaries.

    python -m pdflow.chaos.decode_agent '<json options>'

The engine takes pages only from what the node released (``PagesReleased``), paints every
released page with the canary in the step the node publishes the release (``node.watch``),
keeps it out of reuse for ``REUSE_AFTER_S`` and checks it when the page is taken again, on a
periodic scan and at the end: a broken canary is a write that landed after release, reported
at once as a ``canary`` event. A successful room's pages must hold exactly the room's pattern
(``mismatch`` says where not). Commands: ``room``, ``state`` (ledger, engine free list, open
rooms, a full canary scan), ``quit``.

Mutants, to show the checker goes red (``PDFLOW_CHAOS_MUTANT``):

* ``noop_fence``: the transport claims a receiver-side fence and its ``fence`` does nothing (the
  decode's fence before issue 12 was fixed), and it does not rotate: a writer declared dead
  while alive (paused) has its pages released while its writes are still on their way;
* ``free_on_hold``: the engine reuses a failed room's pages as soon as they are quarantined
  (``PagesHeld``), before any writer drained.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import structlog

from pdflow.chaos.agent_io import (
    MUTANT_VARIABLE,
    clear_quietly,
    configure_logging,
    emit,
    forgotten,
    serve_commands,
)
from pdflow.chaos.kv_pattern import broken_canaries, mismatch, pages_for, paint_canary, rank_caches
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import HostKvCache, RankKv, staging_page_bytes
from pdflow.io.node_common import NodeEvent, PagesHeld, PagesReleased
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport

log = structlog.get_logger("pdflow.chaos.decode")

FREE_ON_HOLD = "free_on_hold"
NOOP_FENCE = "noop_fence"


class NoopFenceTransport(MooncakeTransport):
    """Mutant: says its fence is real, and the fence stops nothing. Like the decode of old main
    it does not rotate either: a rotation retires the engine, which is a real fence of its own
    and would hide this one (a transport whose fence is real has no need to rotate)."""

    @property
    def fence_is_real(self) -> bool:
        return True

    @property
    def can_rotate(self) -> bool:
        return False

    async def fence(self, peer_session_id: str) -> None:
        return None

    async def lift_fence(self, peer_session_id: str) -> None:
        return None


CANARY_SCAN_S = 1.0
STAGING_PAGES = 512
REUSE_AFTER_S = 2.0
"""A released page is not taken again for this long: a late write landing in it within that
time meets its canary (found by the scan or when it is taken), not the next room's bytes."""


class RankPages:
    """One rank's pages as the engine sees them: free (canary painted) or in use.

    Rooms waiting for pages share one event, set on every release and replaced only once it
    has been set, so every waiter wakes on a release (each rechecks and waits again)."""

    def __init__(self, cache: HostKvCache, kv: RankKv, rng: random.Random,
                 reuse_after_s: float = REUSE_AFTER_S) -> None:  # fmt: skip
        self.cache, self.kv, self.rng = cache, kv, rng
        self.reuse_after_s = reuse_after_s
        pool = kv.layout.num_pages
        self.free = set(range(pool))
        self.in_use: set[int] = set()
        self.released_by: dict[int, tuple[int, int, float]] = {}
        self.released_at: dict[int, float] = {}  # monotonic, for the reuse quarantine
        self.freed = anyio.Event()
        paint_canary(cache, kv, range(pool))

    def release(self, pages: tuple[int, ...], room: int, generation: int) -> None:
        strays = [p for p in pages if p not in self.in_use]
        if strays:
            emit(event="violation", kind="release_not_in_use", rank=self.kv.tp_rank,
                 pages=strays, room=room, generation=generation,
                 found_at=time.time())  # fmt: skip
        now, clock = time.time(), time.monotonic()
        for page in pages:
            if page in self.in_use:
                self.in_use.discard(page)
                self.free.add(page)
                self.released_by[page] = (room, generation, now)
                self.released_at[page] = clock
        paint_canary(self.cache, self.kv, [p for p in pages if p in self.free])
        self.freed.set()

    def check(self, pages: list[int], when: str) -> None:
        for page in broken_canaries(self.cache, self.kv, pages):
            room, generation, released_at = self.released_by.get(page, (-1, -1, 0.0))
            emit(event="canary", rank=self.kv.tp_rank, page=page, when=when,
                 released_room=room, released_generation=generation, released_at=released_at,
                 found_at=time.time())  # fmt: skip
            paint_canary(self.cache, self.kv, [page])  # report each landing once

    def reusable(self, now: float) -> list[int]:
        """Free pages out of their reuse quarantine (``now`` on the monotonic clock)."""
        since = self.released_at
        return sorted(p for p in self.free
                      if now - since.get(p, -math.inf) >= self.reuse_after_s)  # fmt: skip

    def reusable_in(self, count: int, now: float) -> float:
        """Seconds until ``count`` pages are reusable if nothing else is released (inf when
        fewer than ``count`` are free: only a release can help)."""
        if len(self.free) < count:
            return math.inf
        ready = sorted(now - self.released_at.get(p, -math.inf) for p in self.free)
        return max(0.0, self.reuse_after_s - ready[len(ready) - count])

    def take(self, count: int) -> list[int] | None:
        ready = self.reusable(time.monotonic())
        if len(ready) < count:
            return None
        taken = self.rng.sample(ready, count)
        self.check(taken, "taken")
        self.free.difference_update(taken)
        self.in_use.update(taken)
        return taken

    async def wait_for_release(self, count: int) -> None:
        """Until a page is released, or until ``count`` pages leave their quarantine."""
        if self.freed.is_set():
            self.freed = anyio.Event()
        with anyio.move_on_after(self.reusable_in(count, time.monotonic())):
            await self.freed.wait()


async def take_all(pages: Sequence[RankPages], indices: list[int],
                   count: int) -> dict[int, list[int]]:  # fmt: skip
    """``count`` pages on every rank in ``indices``, taken at once: holding one rank's pages
    while waiting on another's deadlocks."""
    while True:
        now = time.monotonic()
        short = next((i for i in indices if len(pages[i].reusable(now)) < count), None)
        if short is None:
            break
        await pages[short].wait_for_release(count)
    taken = {}
    for i in indices:
        got = pages[i].take(count)
        assert got is not None
        taken[i] = got
    return taken


def follow_releases(node: DecodeNode, pages: Sequence[RankPages], index_of: dict[int, int],
                    mutant: str) -> None:  # fmt: skip
    """Free (and paint) a room's pages in the very step the node publishes their release
    (``node.watch``, no hand-over to a reader task, so no write can land between the release
    and the paint and be painted over)."""
    freed_early: set[tuple[int, int, int]] = set()

    def on_event(event: NodeEvent) -> None:
        if not isinstance(event, PagesReleased | PagesHeld):
            return
        key = (event.rank, event.room, event.generation)
        if isinstance(event, PagesHeld):
            if mutant != FREE_ON_HOLD:
                return
            # The mutant reuses quarantined pages as if the fence made them safe.
            freed_early.add(key)
        elif key in freed_early:
            freed_early.discard(key)
            return
        pages[index_of[event.rank]].release(event.pages, event.room, event.generation)

    node.watch(on_event)


async def main(options: dict[str, Any]) -> None:
    settings = load_settings(**options["settings"])
    mutant = os.environ.get(MUTANT_VARIABLE, "")
    tp, num_pages = options["tp"], options["num_pages"]
    caches = rank_caches(tp, num_pages)
    rng = random.Random(options["seed"])
    pages = [RankPages(cache, kv, rng) for cache, kv in caches]
    staged = options["staging"]
    staging_bytes = STAGING_PAGES * staging_page_bytes(caches[0][1].kv_buffers) if staged else 0
    transport_class = NoopFenceTransport if mutant == NOOP_FENCE else MooncakeTransport
    transport = await anyio.to_thread.run_sync(
        transport_class.open, MooncakeConfig(host=settings.host)
    )
    async with (
        transport,
        DecodeNode(ranks=[kv for _, kv in caches], transport=transport, settings=settings,
                   staging_bytes=staging_bytes) as node,
        anyio.create_task_group() as tasks,
    ):  # fmt: skip
        index_of = {kv.tp_rank: i for i, (_, kv) in enumerate(caches)}
        follow_releases(node, pages, index_of, mutant)

        async def scan() -> None:
            while True:
                await anyio.sleep(CANARY_SCAN_S)
                for rank_pages in pages:
                    rank_pages.check(sorted(rank_pages.free), "scan")

        tasks.start_soon(scan)
        emit(event="ready", pid=os.getpid(), incarnation=node.incarnation, mutant=mutant,
             ranks=[r.peer.address for r in node.ranks])  # fmt: skip

        async def room(cmd: dict[str, Any]) -> None:
            try:
                await serve_room(cmd)
            except Exception:
                await clear_quietly(node.ranks, cmd["room"])
                raise

        async def serve_room(cmd: dict[str, Any]) -> None:
            room_id, generation = cmd["room"], cmd["generation"]
            ranks = node.ranks
            for rank in ranks:
                await rank.open(room_id, generation, cmd["bootstrap"])
            ready = [(await rank.wait(room_id)).poll is not KVPoll.Failed for rank in ranks]
            count = pages_for(cmd["tokens"])
            held = await take_all(pages, [i for i, ok in enumerate(ready) if ok], count)
            results: dict[int, tuple[str, str]] = {}

            async def one(index: int) -> None:
                rank = ranks[index]
                if index in held:
                    await rank.publish_pages(room_id, held[index])
                final = await rank.wait(room_id, terminal=True)
                results[index] = (final.poll.name, final.reason)

            async def abort_later(delay: float) -> None:
                await anyio.sleep(delay)
                for rank in ranks:
                    if rank.poll(room_id) not in (None, KVPoll.Failed, KVPoll.Success):
                        await rank.abort(room_id, "chaos: the decode side gave up")

            async with anyio.create_task_group() as group:
                if cmd.get("abort_after") is not None:
                    group.start_soon(abort_later, cmd["abort_after"])
                async with anyio.create_task_group() as sides:
                    for index in range(len(ranks)):
                        sides.start_soon(one, index)
                group.cancel_scope.cancel()
            problems = []
            for index, taken in held.items():
                if results[index][0] == "Success":
                    cache, kv = caches[index]
                    found = mismatch(cache, kv, room_id, generation, taken)
                    if found:
                        problems.append(f"rank {kv.tp_rank}: {found}")
            for rank in ranks:
                await rank.clear(room_id)
            for index, rank in enumerate(ranks):
                if not await forgotten(rank, room_id):
                    results[index] = ("NotForgotten", results[index][1])
            ordered = [results[i] for i in range(len(ranks))]
            emit(event="room", room=room_id, generation=generation,
                 results=[r for r, _ in ordered], reasons=[why for _, why in ordered],
                 mismatch=problems, pages=count)  # fmt: skip

        async def state(cmd: dict[str, Any]) -> None:
            ranks_state = []
            for rank, rank_pages in zip(node.ranks, pages, strict=True):
                rank_pages.check(sorted(rank_pages.free), "final")
                snapshot = rank.snapshot()
                ledger = snapshot.ledger
                ranks_state.append({
                    "rank": rank.rank, "pool": ledger.pool_size, "free": ledger.free,
                    "reserved": ledger.reserved, "quarantined": ledger.quarantined,
                    "rooms_open": [s.room for s in snapshot.rooms],
                    "engine_free": len(rank_pages.free), "engine_in_use": len(rank_pages.in_use),
                    "quarantine": [
                        {"room": q.room, "generation": q.generation, "pages": len(q.pages),
                         "staging_bytes": q.staging_bytes,
                         "waiting_on": [[p.address, p.incarnation] for p in q.waiting_on]}
                        for q in rank.quarantine()
                    ],
                })  # fmt: skip
            emit(event="state", incarnation=node.incarnation, ranks=ranks_state,
                 rotations=len(node.rotations))  # fmt: skip

        await serve_commands({"room": room, "state": state})
        tasks.cancel_scope.cancel()
    emit(event="stopped")


if __name__ == "__main__":
    configure_logging()
    anyio.run(main, json.loads(sys.argv[1]), backend="asyncio")
