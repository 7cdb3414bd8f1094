"""The seeded open-loop workload and the router that runs it.

The whole plan is drawn from the seed before the run: arrival times (exponential gaps), sizes,
which prefill and decode instance, aborts from either side and when, and which requests reuse an
earlier request's room id (at that room's next generation; a fresh id when that request is
still running). Arrivals do not wait for earlier requests (open loop); past ``max_in_flight`` an
arrival is shed and counted. A failed attempt is
retried on the same room id with the next generation, on the next prefill instance.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from pdflow.chaos.procs import Agent

MAX_ATTEMPTS = 3
RETRY_PAUSE_S = 1.0
ATTEMPT_TIMEOUT_S = 45.0
"""An attempt whose decode side never answers within this is recorded as not terminal."""


class PlannedRequest(msgspec.Struct, frozen=True):
    index: int
    at: float
    tokens: int
    prefill: int
    decode: int
    chunk_pages: int
    abort_side: str | None = None
    abort_after: float | None = None
    reuse_of: int | None = None
    room: int = 0


class Attempt(msgspec.Struct, kw_only=True):
    request: int
    room: int
    generation: int
    prefill: str
    prefill_life: int
    decode: str
    decode_life: int
    bootstrap: str
    tokens: int
    abort_side: str | None
    probe: bool = False
    started: float
    prefill_done: float | None = None
    decode_done: float | None = None
    prefill_results: list[str] = msgspec.field(default_factory=list)
    prefill_reasons: list[str] = msgspec.field(default_factory=list)
    decode_results: list[str] = msgspec.field(default_factory=list)
    decode_reasons: list[str] = msgspec.field(default_factory=list)
    mismatch: list[str] = msgspec.field(default_factory=list)

    @property
    def decode_ok(self) -> bool:
        return bool(self.decode_results) and all(r == "Success" for r in self.decode_results)

    @property
    def prefill_ok(self) -> bool:
        return bool(self.prefill_results) and all(r == "Success" for r in self.prefill_results)

    @property
    def served(self) -> bool:
        """The decode has the room (every rank Success, its bytes checked): the request goes on
        to decode whatever became of the prefill side, and is never tried again."""
        return self.decode_ok

    @property
    def outcome(self) -> str:
        if not self.decode_results:
            return "not_terminal"
        if self.decode_ok:
            if self.prefill_ok:
                return "success"
            if any(r in ("Killed", "NotRunning") for r in self.prefill_results):
                return "served_prefill_killed"  # its life ended after the last write landed
            return "served_prefill_failed"  # a live prefill failed it: sides_disagree
        if "Killed" in self.prefill_results:
            return "prefill_killed"
        if self.abort_side is not None:
            return f"aborted_by_{self.abort_side}"
        return "failed"


ABORT_SIDES = ("decode", "prefill")


def plan_workload(seed: int, duration_s: float, prefills: int, decodes: int,
                  rate_per_s: float = 3.0, max_requests: int = 2000,
                  abort_sides: tuple[str, ...] = ABORT_SIDES) -> list[PlannedRequest]:  # fmt: skip
    rng = random.Random(f"workload-{seed}")
    plan: list[PlannedRequest] = []
    used_rooms: set[int] = set()
    at = 0.5
    while at < duration_s and len(plan) < max_requests:
        index = len(plan)
        drawn = rng.choices([None, *ABORT_SIDES], weights=[8, 1, 1])[0]
        reuse = rng.random() < 0.25 and index >= 4
        room = rng.randrange(1, 2**48)
        while room in used_rooms:
            room = rng.randrange(1, 2**48)
        used_rooms.add(room)
        # Draws in a fixed order whichever sides may abort, so leaving a side out changes only
        # who aborts, never the rest of the plan.
        tokens = rng.choice([16, 48, 64, 130, 256, 500])
        prefill, decode = rng.randrange(prefills), rng.randrange(decodes)
        chunk_pages = rng.choice([1, 2, 4])
        abort_after = round(rng.uniform(0.0, 0.05), 4) if drawn else None
        reuse_of = rng.randrange(max(0, index - 30), index - 3) if reuse else None
        abort_side = drawn if drawn in abort_sides else None
        plan.append(PlannedRequest(
            index=index, at=round(at, 3), tokens=tokens, prefill=prefill, decode=decode,
            chunk_pages=chunk_pages, abort_side=abort_side,
            abort_after=abort_after if abort_side else None, reuse_of=reuse_of, room=room,
        ))  # fmt: skip
        at += rng.expovariate(rate_per_s)
    return plan


class Router:
    """Runs the plan against the agents and records every attempt."""

    def __init__(self, plan: Sequence[PlannedRequest], prefills: Sequence[Agent],
                 decodes: Sequence[Agent], bootstraps: dict[str, str], t0: float,
                 max_in_flight: int = 32) -> None:  # fmt: skip
        self.plan = list(plan)
        self.prefills, self.decodes = list(prefills), list(decodes)
        self.bootstraps = bootstraps
        self.t0 = t0
        self.max_in_flight = max_in_flight
        self.attempts: list[Attempt] = []
        self.shed: list[int] = []
        self.in_flight = 0
        self.next_generation: dict[int, int] = {}
        self.done = {r.index: anyio.Event() for r in self.plan}
        self.room_of: dict[int, int] = {}
        self.room_busy: dict[int, anyio.Event] = {}
        # Rooms whose last attempt never ended on the decode: never used again (a new
        # generation there would be refused as a duplicate claim, which is right).
        self.stuck: set[int] = set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, tasks: TaskGroup) -> None:
        """Start each request at its time (in ``tasks``); returns after the last arrival."""
        for request in self.plan:
            delay = request.at - self.now()
            if delay > 0:
                await anyio.sleep(delay)
            if self.in_flight >= self.max_in_flight:
                self.shed.append(request.index)
                self.done[request.index].set()
                continue
            self.in_flight += 1
            tasks.start_soon(self._request, request)

    async def _request(self, request: PlannedRequest) -> None:
        try:
            room = request.room
            reused = request.reuse_of
            if (reused is not None and self.done[reused].is_set() and reused in self.room_of
                    and self.room_of[reused] not in self.stuck):  # fmt: skip
                room = self.room_of[reused]
            self.room_of[request.index] = room
            prefill = request.prefill
            for attempt in range(MAX_ATTEMPTS):
                abort = request.abort_side if attempt == 0 else None
                record = await self.attempt(room, request, prefill, abort)
                if record.served or record.outcome == "not_terminal":
                    return
                prefill = (prefill + 1) % len(self.prefills)
                await anyio.sleep(RETRY_PAUSE_S * (attempt + 1))
        finally:
            self.in_flight -= 1
            self.done[request.index].set()

    async def attempt(self, room: int, request: PlannedRequest, prefill_index: int,
                      abort_side: str | None, probe: bool = False) -> Attempt:  # fmt: skip
        """One try of one room: both sides at once; returns when both answered (or gave up)."""
        busy = self.room_busy.get(room)
        while busy is not None and not busy.is_set():
            await busy.wait()
            busy = self.room_busy.get(room)
        self.room_busy[room] = anyio.Event()
        try:
            return await self._attempt(room, request, prefill_index, abort_side, probe)
        finally:
            self.room_busy[room].set()

    async def _attempt(self, room: int, request: PlannedRequest, prefill_index: int,
                       abort_side: str | None, probe: bool) -> Attempt:  # fmt: skip
        generation = self.next_generation.get(room, 0)
        self.next_generation[room] = generation + 1
        prefill, decode = self.prefills[prefill_index], self.decodes[request.decode]
        # No waiting for a killed or paused prefill: a real router does not know either, and
        # the decode must fail such a room on its own (its prefill side answers NotRunning).
        record = Attempt(
            request=request.index, room=room, generation=generation, prefill=prefill.name,
            prefill_life=prefill.life, decode=decode.name, decode_life=decode.life,
            bootstrap=self.bootstraps[prefill.name], tokens=request.tokens,
            abort_side=abort_side, probe=probe, started=self.now(),
        )  # fmt: skip
        self.attempts.append(record)
        common: dict[str, Any] = {"room": room, "generation": generation,
                                  "tokens": request.tokens}  # fmt: skip
        decode_after = request.abort_after if abort_side == "decode" else None
        prefill_after = request.abort_after if abort_side == "prefill" else None
        decoded = await decode.run_room({**common, "bootstrap": record.bootstrap,
                                         "abort_after": decode_after})  # fmt: skip
        sent = await prefill.run_room({**common, "chunk_pages": request.chunk_pages,
                                       "abort_after": prefill_after})  # fmt: skip

        async def prefill_side() -> None:
            await sent.done.wait()
            record.prefill_done = self.now()
            record.prefill_results = list(sent.value.get("results", []))
            record.prefill_reasons = list(sent.value.get("reasons", []))

        async def decode_side() -> None:
            await decoded.done.wait()
            record.decode_done = self.now()
            record.decode_results = list(decoded.value.get("results", []))
            record.decode_reasons = list(decoded.value.get("reasons", []))
            record.mismatch = list(decoded.value.get("mismatch", []))

        with anyio.move_on_after(ATTEMPT_TIMEOUT_S):
            async with anyio.create_task_group() as sides:
                sides.start_soon(prefill_side)
                sides.start_soon(decode_side)
        if not record.decode_results:
            self.stuck.add(room)
        return record
