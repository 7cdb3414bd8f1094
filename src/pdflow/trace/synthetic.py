"""A small deterministic world: one real PrefillEndpoint and one real DecodeEndpoint wired by
hand on a virtual clock, with an engine script per room. It produces real traces for tests,
for `pdflow trace demo`, and for measuring recording and replay at scale.

Each room follows one of these scripts (chosen by a seeded generator, or given explicitly):

* ``ok``       both sides open, pages published, one or more chunks written, Success.
* ``abort``    the decode engine aborts while the transfer is in flight: fence, ABORT, drain, ACK.
* ``fail``     the transfer fails: prefill reports Failed, decode fences and ABORTs, ACK.
* ``timeout``  the prefill engine never opens the room: the decode's transfer clock expires.
* ``misuse``   like ``ok``, but the decode engine first clears the open room (a LocalProtocolError,
               recorded as an error step; nothing changes).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ClearRoom,
    DecodeEndpointConfig,
    NeedTopology,
    OpenReceiver,
    OpenRoom,
    PrefillEndpointConfig,
    PrefillInfo,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    RoomRemoved,
    TimerFired,
    TopologyKnown,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.errors import InvalidInput, ProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import (
    AbortRequested,
    InitTransfer,
    PublishPages,
    SendChunk,
    TransferCompleted,
)
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.outputs import Output, SendMessage, StartTransfer, StatusChanged
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts
from pdflow.core.resources.page_ledger import PagesFreed
from pdflow.trace.format import message_id
from pdflow.trace.observe import TracedEndpoint
from pdflow.trace.recorder import TraceRecorder

SCRIPTS = ("ok", "abort", "fail", "timeout", "misuse")
_WEIGHTS = (80, 6, 6, 2, 6)

PREFILL_ID = "prefill-0"
DECODE_ID = "decode-0"
BOOTSTRAP = "127.0.0.1:8998"
PREFILL_PEER = PeerId("127.0.0.1:17000", "prefill-life-1", 0)
DECODE_PEER = PeerId("127.0.0.1:18000", "decode-life-1", 0)
TIMEOUTS = Timeouts(bootstrap_timeout=5.0, waiting_timeout=5.0)
PAGES_PER_ROOM = 4
LATENCY = 0.0005


@dataclass(frozen=True)
class _PublishLater:
    """The decode engine retries reserving pages for a room (not an endpoint input)."""

    room: int


@dataclass(order=True)
class _Event:
    t: float
    order: int
    target: str = field(compare=False)
    input: AnyEndpointInput | _PublishLater = field(compare=False)


@dataclass
class WorldStats:
    steps: int = 0
    errors: int = 0
    """Inputs the core refused (recorded as error steps)."""
    removed: int = 0
    """Room removals, over both endpoints."""


def choose_scripts(rooms: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return rng.choices(SCRIPTS, weights=_WEIGHTS, k=rooms)


class SyntheticWorld:
    def __init__(
        self,
        recorder: TraceRecorder | Mapping[str, TraceRecorder],
        scripts: Sequence[str],
        *,
        seed: int = 0,
        spacing: float = 0.002,
        num_pages: int = 2048,
    ) -> None:
        unknown = sorted(set(scripts) - set(SCRIPTS))
        if unknown:
            raise ValueError(f"unknown room scripts {unknown}; choose from {SCRIPTS}")
        self.scripts = list(scripts)
        self.rng = random.Random(seed)
        self.spacing = spacing
        self.stats = WorldStats()
        plan: dict[str, object] = {"scripts": self.scripts, "spacing": spacing}
        prefill_config = PrefillEndpointConfig(me=PREFILL_PEER, timeouts=TIMEOUTS)
        decode_config = DecodeEndpointConfig(
            me=DECODE_PEER, num_pages=num_pages, timeouts=TIMEOUTS, num_kv_heads=8
        )
        # One recorder for the world (the simulator's way) or one per endpoint (a deployment's).
        recorders = (
            recorder
            if isinstance(recorder, Mapping)
            else {PREFILL_ID: recorder, DECODE_ID: recorder}
        )
        self.endpoints: dict[str, TracedEndpoint] = {
            PREFILL_ID: recorders[PREFILL_ID].wrap(
                PREFILL_ID, PrefillEndpoint(prefill_config), seed, plan
            ),
            DECODE_ID: recorders[DECODE_ID].wrap(
                DECODE_ID, DecodeEndpoint(decode_config), seed, plan
            ),
        }
        self.by_peer = {PREFILL_PEER: PREFILL_ID, DECODE_PEER: DECODE_ID}
        self.free_pages = list(range(num_pages))
        self.armed: dict[str, float] = {}
        self.events: list[_Event] = []
        self._order = 0

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> WorldStats:
        for index, script in enumerate(self.scripts):
            self._start_room(index + 1, script, index * self.spacing)
        while self.events:
            event = heapq.heappop(self.events)
            if isinstance(event.input, _PublishLater):
                self._publish(event.input.room, event.t)
                continue
            if isinstance(event.input, TimerFired):
                if self.armed.get(event.target) != event.t:
                    continue  # superseded by a later re-arm
                del self.armed[event.target]
            self._step(event.target, event.input, event.t)
        return self.stats

    def _at(self, t: float, target: str, inp: AnyEndpointInput | _PublishLater) -> None:
        self._order += 1
        heapq.heappush(self.events, _Event(t, self._order, target, inp))

    def _start_room(self, room: int, script: str, t: float) -> None:
        generation = 1
        self._at(t, DECODE_ID, OpenReceiver(room, generation, BOOTSTRAP))
        if script == "misuse":
            self._at(t, DECODE_ID, ClearRoom(room))
        if script != "timeout":
            self._at(t + LATENCY / 2, PREFILL_ID, OpenRoom(room, generation))

    def _step(self, name: str, inp: AnyEndpointInput, now: float) -> None:
        endpoint = self.endpoints[name]
        self.stats.steps += 1
        try:
            step = endpoint.handle(inp, now)
        except (ProtocolError, InvalidInput):
            self.stats.errors += 1
            return
        seq = getattr(endpoint, "last_seq", None)
        for index, output in enumerate(step.outputs):
            msg_id = message_id(name, seq, index) if seq is not None else None
            self._react(name, output, now, msg_id)
        if step.timer_at is not None and self.armed.get(name) != step.timer_at:
            self.armed[name] = step.timer_at
            self._at(step.timer_at, name, TimerFired())

    # ---- the shell and the engines, reduced to what the protocol needs -------------------------
    def _react(self, name: str, output: Output, now: float, msg_id: str | None) -> None:
        if isinstance(output, SendMessage):
            jitter = self.rng.random() * LATENCY
            target = self.by_peer[output.to]
            self._at(now + LATENCY + jitter, target, Received(output.message, msg_id))
        elif isinstance(output, StartTransfer):
            self._transfer(output, now)
        elif isinstance(output, StatusChanged):
            self._status(name, output, now)
        elif isinstance(output, PagesFreed):
            self.free_pages.extend(output.pages)
        elif isinstance(output, RoomRemoved):
            self.stats.removed += 1
        elif isinstance(output, NeedTopology):
            self._at(now + LATENCY, DECODE_ID, TopologyKnown(_prefill_info()))

    def _transfer(self, output: StartTransfer, now: float) -> None:
        ok = self.scripts[output.room - 1] != "fail"
        duration = 0.0005 * max(len(output.src_pages), 1)
        # The shell reads the engine's aux row for a last chunk (here: the room id, 8 bytes).
        aux = output.room.to_bytes(8, "little") if ok and output.src_aux_index is not None else None
        done = TransferCompleted(
            output.room, output.generation, output.seq, ok, "" if ok else "injected link failure",
            aux=aux,
        )
        self._at(now + duration, PREFILL_ID, done)

    def _status(self, name: str, output: StatusChanged, now: float) -> None:
        room, script = output.room, self.scripts[output.room - 1]
        if output.poll.is_terminal:
            self._at(now, name, ClearRoom(room))
        elif name == DECODE_ID and output.poll is KVPoll.WaitingForInput:
            self._publish(room, now)
        elif name == DECODE_ID and output.poll is KVPoll.Transferring and script == "abort":
            self._at(now + 0.0007, DECODE_ID, RoomCall(room, AbortRequested("engine cancelled")))
        elif name == PREFILL_ID and output.poll is KVPoll.WaitingForInput:
            self._send_chunks(room, now)

    def _publish(self, room: int, now: float) -> None:
        if len(self.free_pages) < PAGES_PER_ROOM:
            self._at(now + 0.01, DECODE_ID, _PublishLater(room))  # no memory yet: try again later
            return
        pages = tuple(self.free_pages[:PAGES_PER_ROOM])
        del self.free_pages[:PAGES_PER_ROOM]
        self._at(now, DECODE_ID, PublishPages(room, pages, aux_index=room % 64))

    def _send_chunks(self, room: int, now: float) -> None:
        chunks = 1 + room % 2
        self._at(now, PREFILL_ID, RoomCall(room, InitTransfer(PAGES_PER_ROOM, aux_index=room % 64)))
        per_chunk = PAGES_PER_ROOM // chunks
        for index in range(chunks):
            pages = tuple(range(index * per_chunk, (index + 1) * per_chunk))
            call = SendChunk(pages, is_last=index == chunks - 1)
            self._at(now + 0.0001 * (index + 1), PREFILL_ID, RoomCall(room, call))


def _prefill_info() -> PrefillInfo:
    return PrefillInfo(
        bootstrap=BOOTSTRAP, tp_size=1, cp_size=1, pp_size=1, dp_size=1, page_size=16,
        kv_cache_dtype="auto", policy=AllocationPolicy.EARLY,
        ranks=(RegisteredPrefillRank(0, 0, 0, 0, PREFILL_PEER),),
    )  # fmt: skip
