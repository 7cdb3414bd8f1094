"""Pure protocol-core throughput and footprint, on one core, with no I/O at all.

Two figures:

* **steps per second**: one PrefillEndpoint and one DecodeEndpoint (TP 1 -> 1, early
  allocation) carry rooms end to end: open, topology, pages published, metadata, chunks
  written, Success, cleared. A small in-memory driver stands in for the shells and the
  engines: it routes every message to the other endpoint, answers every ``StartTransfer`` with
  a successful ``TransferCompleted`` and performs the engine's calls when a room's status asks for
  them. Rooms run in waves of ``in_flight`` concurrent rooms. The headline rate counts every
  ``handle()`` call over the wall time of the whole run, driver included, so it is a lower
  bound on the core's own rate (reported too, from time spent inside ``handle()`` alone).
* **bytes per in-flight room**: ``tracemalloc`` growth while ``rooms`` rooms are opened and
  left in Transferring, on a decode endpoint (pages published, waiting for Success) and on a
  prefill endpoint (metadata decoded from msgpack like off the wire, last chunk's write
  outstanding), divided by the room count.

    python -m benchmarks.core_steps --rooms 20000 --memory-rooms 100000 --json out/core.json
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat, starmap
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common import write_json
from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ClearRoom,
    DecodeEndpointConfig,
    Dropped,
    NeedTopology,
    OpenReceiver,
    OpenRoom,
    PrefillEndpointConfig,
    PrefillInfo,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    RoomRemoved,
    TopologyKnown,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import InitTransfer, PublishPages, SendChunk, TransferCompleted
from pdflow.core.protocol.messages import PeerId, RoomMetadata
from pdflow.core.protocol.outputs import SendMessage, StartTransfer, StatusChanged
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.core.resources.page_ledger import PagesFreed

Progress = Callable[[str], None]

BOOTSTRAP = "127.0.0.1:8998"
PREFILL = PeerId("127.0.0.1:17001", "prefill-incarnation", 0)
DECODE = PeerId("127.0.0.1:17101", "decode-incarnation", 0)
GENERATION = 1
# The simulated clock advances this much per handled input; no timer ever comes due.
_TICK_S = 1e-6
# The polls the engines react to, bound once: a member read off its class costs ~0.1 us on
# Python 3.11 (src/pdflow/core/framework/kvpoll.py), and the driver is counted in the rate.
_FAILED, _SUCCESS, _WAITING = KVPoll.Failed, KVPoll.Success, KVPoll.WaitingForInput


def _prefill_info(page_size: int) -> PrefillInfo:
    return PrefillInfo(
        bootstrap=BOOTSTRAP,
        tp_size=1,
        cp_size=1,
        pp_size=1,
        dp_size=1,
        page_size=page_size,
        kv_cache_dtype="auto",
        policy=AllocationPolicy.EARLY,
        ranks=(RegisteredPrefillRank(dp=0, cp=0, tp=0, pp=0, peer=PREFILL),),
    )


def _endpoints(num_pages: int, page_size: int) -> tuple[PrefillEndpoint, DecodeEndpoint]:
    prefill = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL))
    decode = DecodeEndpoint(
        DecodeEndpointConfig(
            me=DECODE, num_pages=num_pages, page_size=page_size, session_id="decode-session"
        )
    )
    return prefill, decode


def _chunk_bounds(num_pages: int, chunks: int) -> list[tuple[int, int, bool]]:
    """Where each of a room's chunks starts and ends in its pages, and whether it is last."""
    size = -(-num_pages // chunks)
    return [(start, start + size, start + size >= num_pages) for start in range(0, num_pages, size)]


class PairDriver:
    """Plays both shells and both engines around one prefill/decode endpoint pair."""

    def __init__(self, pages_per_room: int, chunks_per_room: int, in_flight: int) -> None:
        page_size = 16
        self.pages_per_room = pages_per_room
        # Every room has pages_per_room pages: its chunks' bounds are worked out once.
        self.chunk_bounds = _chunk_bounds(pages_per_room, chunks_per_room)
        self.prefill, self.decode = _endpoints(in_flight * pages_per_room, page_size)
        self.info = _prefill_info(page_size)
        self.free_pages: deque[int] = deque(range(in_flight * pages_per_room))
        self.room_pages: dict[int, tuple[int, ...]] = {}
        self.queue: deque[tuple[PrefillEndpoint | DecodeEndpoint, AnyEndpointInput]] = deque()
        self.now = 0.0
        self.handled = 0
        self.core_seconds = 0.0
        self.completed = 0

    def open(self, room: int) -> None:
        self.queue.append((self.prefill, OpenRoom(room, GENERATION)))
        self.queue.append((self.decode, OpenReceiver(room, GENERATION, BOOTSTRAP)))

    def drain(self) -> None:
        # The driver's own cost is counted in the headline rate, so it is kept small: the
        # per-step path reads locals, and the totals are stored back once the queue is empty.
        # The three most frequent outputs (status changes, messages, transfers) are carried
        # out in the loop itself, without a call each (a Success is cleared here; the
        # engines' other reactions are _engine_reacts'); _carry_out takes the rest.
        clock = time.perf_counter
        queue, carry_out, engine_reacts = self.queue, self._carry_out, self._engine_reacts
        popleft, append = queue.popleft, queue.append
        prefill, decode = self.prefill, self.decode
        now, handled, core_seconds = self.now, self.handled, self.core_seconds
        while queue:
            endpoint, inp = popleft()
            now += _TICK_S
            started = clock()
            step = endpoint.handle(inp, now)
            core_seconds += clock() - started
            handled += 1
            for output in step.outputs:
                kind = type(output)
                if kind is StatusChanged:
                    poll = output.poll
                    if poll is _SUCCESS:
                        append((endpoint, ClearRoom(output.room)))
                    elif poll is _WAITING or poll is _FAILED:
                        engine_reacts(endpoint, output)
                elif kind is SendMessage:
                    target = prefill if output.to == PREFILL else decode
                    append((target, Received(output.message)))
                elif kind is StartTransfer:
                    done = TransferCompleted(output.room, output.generation, output.seq, ok=True)
                    append((prefill, done))
                else:
                    carry_out(endpoint, output)
        self.now, self.handled, self.core_seconds = now, handled, core_seconds

    def _carry_out(self, endpoint: PrefillEndpoint | DecodeEndpoint, output: Any) -> None:
        # The outputs drain() does not carry out itself (status changes, messages and
        # transfers never reach here), compared by type instead of an isinstance chain.
        kind = type(output)
        if kind is RoomRemoved:
            self.completed += endpoint is self.decode
        elif kind is PagesFreed:
            self.free_pages.extend(output.pages)
        elif kind is NeedTopology:
            self.queue.append((self.decode, TopologyKnown(self.info)))
        elif isinstance(output, Dropped):
            raise RuntimeError(f"{endpoint.role} dropped an input: {output.kind}: {output.reason}")
        else:
            raise RuntimeError(f"the benchmark driver does not handle {type(output).__name__}")

    def _engine_reacts(
        self, endpoint: PrefillEndpoint | DecodeEndpoint, change: StatusChanged
    ) -> None:
        # drain() calls this for WaitingForInput and Failed only (it clears a Success itself).
        room = change.room
        if change.poll is _FAILED:
            raise RuntimeError(f"{endpoint.role} room {room} failed: {change.reason}")
        if change.poll is _WAITING and endpoint is self.decode:
            # pages_per_room pages off the free list, in order, without a Python call per page
            pages = tuple(starmap(self.free_pages.popleft, repeat((), self.pages_per_room)))
            self.room_pages[room] = pages
            self.queue.append((endpoint, PublishPages(room, pages, aux_index=None)))
        elif change.poll is _WAITING:
            pages = self.room_pages.pop(room)
            queue = self.queue
            queue.append((endpoint, RoomCall(room, InitTransfer(len(pages)))))
            for start, end, is_last in self.chunk_bounds:
                queue.append((endpoint, RoomCall(room, SendChunk(pages[start:end], is_last))))


def measure_steps(
    rooms: int, in_flight: int, pages_per_room: int, chunks_per_room: int, progress: Progress
) -> dict[str, Any]:
    """Carry ``rooms`` rooms end to end, ``in_flight`` at a time; count ``handle()`` calls."""
    driver = PairDriver(pages_per_room, chunks_per_room, in_flight)
    started = time.perf_counter()
    for first in range(0, rooms, in_flight):
        for room in range(first, min(first + in_flight, rooms)):
            driver.open(room)
        driver.drain()
    wall = time.perf_counter() - started
    if driver.completed != rooms or driver.prefill.rooms or driver.decode.rooms:
        raise RuntimeError(
            f"only {driver.completed} of {rooms} rooms completed; {len(driver.prefill.rooms)} "
            f"prefill and {len(driver.decode.rooms)} decode rooms left open"
        )
    result = {
        "rooms": rooms,
        "in_flight": in_flight,
        "pages_per_room": pages_per_room,
        "chunks_per_room": chunks_per_room,
        "handle_calls": driver.handled,
        "handle_calls_per_room": driver.handled / rooms,
        "seconds": wall,
        "steps_per_second": driver.handled / wall,
        "core_steps_per_second": driver.handled / driver.core_seconds,
        "rooms_per_second": rooms / wall,
    }
    progress(
        f"  {rooms} rooms, {driver.handled} handle() calls in {wall:.2f} s: "
        f"{result['steps_per_second']:,.0f} steps/s (inside handle() alone "
        f"{result['core_steps_per_second']:,.0f})"
    )
    return result


def _bytes_per_room(open_rooms: Callable[[], None], rooms: int) -> float:
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    open_rooms()
    gc.collect()
    return (tracemalloc.get_traced_memory()[0] - before) / rooms


def _decode_rooms_transferring(rooms: int, pages_per_room: int) -> float:
    _, decode = _endpoints(rooms * pages_per_room, 16)
    decode.handle(TopologyKnown(_prefill_info(16)), 0.0)

    def open_rooms() -> None:
        for room in range(rooms):
            decode.handle(OpenReceiver(room, GENERATION, BOOTSTRAP), 1.0)
            first = room * pages_per_room
            pages = tuple(range(first, first + pages_per_room))
            decode.handle(PublishPages(room, pages, aux_index=room), 1.0)

    per_room = _bytes_per_room(open_rooms, rooms)
    stuck = [r for r, room in decode.rooms.items() if room.poll is not KVPoll.Transferring]
    if len(decode.rooms) != rooms or stuck:
        raise RuntimeError(f"decode rooms not all Transferring (e.g. {stuck[:3]})")
    return per_room


def _prefill_rooms_transferring(rooms: int, pages_per_room: int) -> float:
    prefill, _ = _endpoints(1, 16)
    encode = msgspec.msgpack.Encoder().encode
    decode_metadata = msgspec.msgpack.Decoder(RoomMetadata).decode

    def open_rooms() -> None:
        for room in range(rooms):
            first = room * pages_per_room
            pages = tuple(range(first, first + pages_per_room))
            wire = encode(
                RoomMetadata(
                    room=room,
                    generation=GENERATION,
                    decode=DECODE,
                    prefill=PREFILL,
                    session_id="decode-session",
                    dst_pages=pages,
                    aux_index=room,
                    required_dst_info_num=1,
                )
            )
            prefill.handle(OpenRoom(room, GENERATION), 1.0)
            prefill.handle(Received(decode_metadata(wire)), 1.0)
            prefill.handle(RoomCall(room, InitTransfer(pages_per_room, aux_index=room)), 1.0)
            prefill.handle(RoomCall(room, SendChunk(pages, is_last=True)), 1.0)

    per_room = _bytes_per_room(open_rooms, rooms)
    stuck = [r for r, room in prefill.rooms.items() if room.poll is not KVPoll.Transferring]
    if len(prefill.rooms) != rooms or stuck or prefill.outstanding_writes != rooms:
        raise RuntimeError(f"prefill rooms not all Transferring (e.g. {stuck[:3]})")
    return per_room


def measure_room_state(rooms: int, pages_per_room: int, progress: Progress) -> dict[str, Any]:
    """tracemalloc bytes per in-flight room on each endpoint, with ``rooms`` rooms open."""
    tracing_already = tracemalloc.is_tracing()
    if not tracing_already:
        tracemalloc.start()
    try:
        decode_bytes = _decode_rooms_transferring(rooms, pages_per_room)
        prefill_bytes = _prefill_rooms_transferring(rooms, pages_per_room)
    finally:
        if not tracing_already:
            tracemalloc.stop()
    progress(
        f"  {rooms} rooms in Transferring ({pages_per_room} page(s) each): decode "
        f"{decode_bytes:,.0f} B/room, prefill {prefill_bytes:,.0f} B/room"
    )
    return {
        "rooms": rooms,
        "pages_per_room": pages_per_room,
        "decode_bytes_per_room": decode_bytes,
        "prefill_bytes_per_room": prefill_bytes,
        "max_bytes_per_room": max(decode_bytes, prefill_bytes),
    }


def run(
    *,
    rooms: int = 20_000,
    in_flight: int = 256,
    pages_per_room: int = 4,
    chunks_per_room: int = 2,
    memory_rooms: int = 100_000,
    memory_pages_per_room: int = 1,
    progress: Progress = print,
) -> dict[str, Any]:
    """Both core figures as a dict: ``steps`` and ``room_state``."""
    for name, value in (
        ("rooms", rooms),
        ("in_flight", in_flight),
        ("pages_per_room", pages_per_room),
        ("chunks_per_room", chunks_per_room),
        ("memory_rooms", memory_rooms),
        ("memory_pages_per_room", memory_pages_per_room),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if chunks_per_room > pages_per_room:
        raise ValueError(f"chunks_per_room {chunks_per_room} exceeds pages_per_room")
    progress(f"core_steps: {rooms} rooms end to end, {in_flight} in flight")
    steps = measure_steps(rooms, in_flight, pages_per_room, chunks_per_room, progress)
    progress(f"core_steps: state of {memory_rooms} in-flight rooms")
    state = measure_room_state(memory_rooms, memory_pages_per_room, progress)
    return {"benchmark": "core_steps", "steps": steps, "room_state": state}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--pages-per-room", type=int, default=4)
    parser.add_argument("--chunks-per-room", type=int, default=2)
    parser.add_argument("--memory-rooms", type=int, default=100_000)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    result = run(
        rooms=args.rooms,
        in_flight=args.in_flight,
        pages_per_room=args.pages_per_room,
        chunks_per_room=args.chunks_per_room,
        memory_rooms=args.memory_rooms,
    )
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
