"""Decode admission in the node, with real processes (a prefill process, Mooncake TCP).

The sglang#30033 pattern: requests waiting for or in transfer cannot be retracted, and a running
request grows while it decodes. If the decode admits a request whenever its prompt and reserve
fit, the transfer queue can take every free page; the running request then cannot grow, and
nothing can finish. The node's admission (``DecodeRank.admit``) admits only while the pages left
cover the largest growth any single admitted request may still need, so every request finishes.
The same engine without admission stalls, which shows the pattern is real here.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_decode import DecodeNode, DecodeRank
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

from .node_harness import decode_caches, prefill_process
from .node_kv_pattern import GEOMETRY, pages_for

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

PAGE = GEOMETRY["page_size"]
POOL = 12
PROMPT = 2 * PAGE  # two pages of KV come from the prefill
RESERVE = PAGE  # one page reserved for decoding at admission
MAX_NEW = 3 * PAGE  # a request may grow by two more pages while it decodes
REQUESTS = 10
STALL_S = 6.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class GrowingDecodeEngine:
    """Pages from one free list; a room's pages are prompt + reserve, then it decodes (one at a
    time, never retracted), growing to its worst case before it frees everything."""

    def __init__(self, rank: DecodeRank, bootstrap: str, use_admission: bool) -> None:
        self.rank = rank
        self.bootstrap = bootstrap
        self.use_admission = use_admission
        self.free = list(range(POOL))
        self.changed = anyio.Event()
        self.running: list[tuple[int, list[int]]] = []
        self.running_changed = anyio.Event()
        self.finished = 0
        self.peak_admitted = 0

    async def take(self, count: int) -> list[int]:
        while len(self.free) < count:
            self.changed = anyio.Event() if self.changed.is_set() else self.changed
            await self.changed.wait()
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)
        self.changed.set()

    async def receive(self, room: int) -> None:
        await self.rank.open(room, 0, self.bootstrap)
        assert (await self.rank.wait(room)).poll is KVPoll.WaitingForInput
        held = math.ceil((PROMPT + RESERVE) / PAGE)
        if self.use_admission:
            held = await self.rank.admit(room, input_len=PROMPT, max_new=MAX_NEW)
            gate = self.rank._node.admission[self.rank.rank]
            self.peak_admitted = max(self.peak_admitted, gate.admitted)
        pages = await self.take(held)
        await self.rank.publish_pages(room, pages[: pages_for(PROMPT)])
        status = await self.rank.wait(room, terminal=True)
        assert status.poll is KVPoll.Success, status
        await self.rank.clear(room)
        self.running.append((room, pages))
        self.running_changed.set()

    async def decode(self) -> None:
        """The running batch, one request at a time: grow to the worst case, then finish."""
        growth = math.ceil((PROMPT + MAX_NEW) / PAGE) - math.ceil((PROMPT + RESERVE) / PAGE)
        while True:
            while not self.running:
                self.running_changed = anyio.Event()
                await self.running_changed.wait()
            room, pages = self.running.pop(0)
            pages += await self.take(growth)
            self.give(pages)
            if self.use_admission:
                self.rank.finish_request(room, 0)
            self.finished += 1


async def _serve(tmp: str, use_admission: bool) -> GrowingDecodeEngine:
    settings: dict[str, Any] = {"trace_dir": tmp, "heartbeat_interval": 0.5}
    caches = decode_caches(1, num_pages=POOL)
    transport = MooncakeTransport.open()
    options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 64, "tp": 1}
    async with anyio.create_task_group() as tasks, transport:  # noqa: SIM117 - tasks first
        async with prefill_process(tasks, options) as prefill:
            bootstrap = prefill.ready["bootstrap"]
            async with DecodeNode(ranks=[kv for _, kv in caches], transport=transport,
                                  settings=load_settings(**settings),
                                  admission_reserve_tokens=RESERVE,
                                  admission_clip_max_new=MAX_NEW) as node:  # fmt: skip
                engine = GrowingDecodeEngine(node.ranks[0], bootstrap, use_admission)
                with anyio.move_on_after(STALL_S * 3 if use_admission else STALL_S):
                    async with anyio.create_task_group() as work:
                        work.start_soon(engine.decode)
                        for room in range(REQUESTS):
                            await prefill.start_room(room, 0, PROMPT)
                            work.start_soon(engine.receive, room)
                        while engine.finished < REQUESTS:
                            await anyio.sleep(0.05)
                        work.cancel_scope.cancel()
            tasks.cancel_scope.cancel()
    return engine


async def test_admission_lets_every_request_finish_where_greedy_admission_deadlocks(
    tmp_path: anyio.Path,
) -> None:
    admitted = await _serve(str(tmp_path / "admission"), use_admission=True)
    assert admitted.finished == REQUESTS
    # At most three at once: 3 pages each, and the last admission must leave 2 for one growth.
    assert admitted.peak_admitted == 3
    assert sorted(admitted.free) == list(range(POOL))
    greedy = await _serve(str(tmp_path / "greedy"), use_admission=False)
    assert greedy.finished == 0, "greedy admission should stall with every page in transfer"
    assert greedy.free == []
