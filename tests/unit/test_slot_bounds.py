"""Bounded state (docs/architecture.md, "Bounded state"): what a prefill endpoint keeps per room
id does not grow with failures, stray messages or the number of room ids it served.
Invariant: bounded_room_state.

Measured as a size bound, not a timing: the retained size of the endpoint (every object it
reaches) after 100,000 failed-and-cleared generations, again after 100,000 stray ABORTs, and
after 100,000 distinct room ids that each succeeded once (SGLang's random room ids, one per
request), equals its size after a short warm-up to within a few KiB. A stray ABORT below a
room id's opened mark keeps one cancel floor per room id (its ACK's promise), whatever the
count, and none past max_pending_room_ids (those are not ACKed).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    Dropped,
    OpenRoom,
    PrefillEndpointConfig,
    Received,
    RoomCall,
    TimerFired,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.protocol.inputs import AbortRequested, InitTransfer, SendChunk, TransferCompleted
from pdflow.core.protocol.messages import Abort, AbortAck, PeerId, RoomMetadata
from pdflow.core.protocol.outputs import SendMessage, StartTransfer
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts

PREFILL = PeerId("127.0.0.1:7000", "p1", 0)
DECODE = PeerId("127.0.0.1:8000", "d1", 0)
ROOM_IDS = 8
"""The router's room ids, each retried on its next generation."""
FAILURES = 100_000
STRAY = 100_000
SLACK_BYTES = 4096
"""Counters and the like may gain a key or two; nothing may grow per failure."""


def retained_bytes(root: object) -> int:
    """Bytes of every object reachable from ``root`` (classes, modules, functions excluded)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, type(sys), type(retained_bytes))):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def abort(room: int, generation: int) -> Received:
    return Received(Abort(room=room, generation=generation, decode=DECODE, prefill=PREFILL))


def fail_and_clear(p: PrefillEndpoint, generations: Iterator[int], now: float) -> None:
    """Each room id's next generation opens, fails on the prefill, is cleared, and the
    decode's answering ABORT arrives (bug C's story)."""
    for room in range(ROOM_IDS):
        generation = next(generations)
        p.handle(OpenRoom(room, generation), now)
        p.handle(RoomCall(room, AbortRequested("prefill failed")), now)
        p.handle(ClearRoom(room), now)
        p.handle(abort(room, generation), now)


@pytest.mark.invariant("bounded_room_state")
@pytest.mark.parametrize("policy", list(AllocationPolicy), ids=lambda p: p.value)
def test_failures_and_stray_aborts_leave_memory_flat(policy: AllocationPolicy) -> None:
    config = PrefillEndpointConfig(me=PREFILL, policy=policy, timeouts=Timeouts(30.0, 30.0))
    p = PrefillEndpoint(config)
    generations = iter(range(1, 10**9))
    for _ in range(100):  # warm-up: every container and counter exists
        fail_and_clear(p, generations, 0.0)
    warm = retained_bytes(p)
    for _ in range(FAILURES // ROOM_IDS):
        fail_and_clear(p, generations, 1.0)
    after_failures = retained_bytes(p)
    last = next(generations) - 1
    acked = 0
    for i in range(STRAY):  # late, duplicated or forged ABORTs of generations already finished
        step = p.handle(abort(i % ROOM_IDS, 1 + i % last), 2.0)
        acked += sum(isinstance(o, SendMessage) and isinstance(o.message, AbortAck)
                     for o in step.outputs)  # fmt: skip
    p.handle(TimerFired(), 10_000.0)
    after_stray = retained_bytes(p)
    print(f"{policy.value}: warm {warm} B, +{FAILURES} failures {after_failures} B, "
          f"+{STRAY} stray ABORTs {after_stray} B")  # fmt: skip
    assert acked == STRAY  # every one is answered
    assert after_failures - warm <= SLACK_BYTES
    assert after_stray - warm <= SLACK_BYTES
    assert not p.rooms and not p.draining
    # Below the mark, an ABORT's generation may never have opened (the engine may open it
    # late): each room id keeps one cancel floor backing its ACKs, and with it its mark.
    assert p.snapshot().pending == ROOM_IDS
    assert all(p.pending[room].cancelled < p.opened.get(room) for room in range(ROOM_IDS))
    assert len(p.opened) == ROOM_IDS
    if p.ready_table is not None:
        assert p.ready_table.held() <= ROOM_IDS


@pytest.mark.invariant("bounded_room_state", "abort_is_final")
def test_forged_aborts_for_fresh_room_ids_stop_at_the_cap() -> None:
    """ABORTs for room ids never opened are each kept (abort_is_final) up to the cap; past it
    they are dropped unanswered: no ACK, no promise, no growth."""
    p = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, max_pending_room_ids=500))
    acked = 0
    for room in range(5_000):
        step = p.handle(abort(10_000 + room, 1), 0.0)
        acked += sum(isinstance(o, SendMessage) for o in step.outputs)
    assert acked == 500 and p.snapshot().pending == 500
    assert p.counters["dropped_unopened_full"] == 4_500
    # A kept cancel still wins when its room opens, and the room id then holds nothing pending.
    p.handle(OpenRoom(10_000, 1), 1.0)
    assert p.rooms[10_000].poll.name == "Failed" and p.snapshot().pending == 499


@pytest.mark.invariant("bounded_room_state", "abort_is_final")
def test_aborts_below_the_mark_stop_at_the_cap() -> None:
    """Each room id opened generation 2 (generation 1 may still open late) and the ABORT for
    generation 1 arrives: kept as a cancel floor, which keeps the mark through forgetting, up
    to max_pending_room_ids room ids; past it the ABORT is dropped unanswered (no ACK, no
    promise), and an ABORT for a room id's mark generation is still ACKed, keeping nothing."""
    config = PrefillEndpointConfig(me=PREFILL, max_pending_room_ids=50, max_finished_room_ids=10)
    p = PrefillEndpoint(config)
    acked = 0
    for room in range(500):
        p.handle(OpenRoom(room, 2), 0.0)
        p.handle(RoomCall(room, AbortRequested("prefill failed")), 0.0)
        p.handle(ClearRoom(room), 0.0)
        step = p.handle(abort(room, 1), 0.0)
        acked += sum(isinstance(o, SendMessage) for o in step.outputs)
        step = p.handle(abort(room, 2), 0.0)
        assert [type(o.message) for o in step.outputs if isinstance(o, SendMessage)] == [AbortAck]
    assert acked == 50 and p.snapshot().pending == 50
    assert p.counters["dropped_unopened_full"] == 450
    assert all(p.opened.get(room) == 2 for room in range(50))  # kept past max_finished
    assert len(p.opened) <= 50 + 10


DISTINCT_ROOMS = 100_000
REMEMBERED = 1_000
"""max_finished_room_ids for the test: small, so the warm-up already fills it."""


def succeed_and_clear(p: PrefillEndpoint, room: int, now: float) -> None:
    """One request of its own room id: opened, written, succeeded, cleared."""
    p.handle(OpenRoom(room, 0), now)
    metadata = RoomMetadata(room=room, generation=0, decode=DECODE, prefill=PREFILL,
                            session_id="s", dst_pages=(7,), aux_index=None,
                            required_dst_info_num=1)  # fmt: skip
    p.handle(Received(metadata), now)
    p.handle(RoomCall(room, InitTransfer(1)), now)
    step = p.handle(RoomCall(room, SendChunk((3,), True)), now)
    [write] = [o for o in step.outputs if isinstance(o, StartTransfer)]
    p.handle(TransferCompleted(room, 0, write.seq, True, checksum=0), now)
    assert p.generation_of(room) == 0 and p.rooms[room].poll.name == "Success"
    p.handle(ClearRoom(room), now)


@pytest.mark.invariant("bounded_room_state")
def test_distinct_successful_room_ids_leave_memory_flat() -> None:
    """SGLang draws a random room id per request: the opened marks of room ids that hold
    nothing any more are forgotten past max_finished_room_ids, so 100,000 requests keep what
    1,000 keep. A late ABORT for a forgotten one is still answered at once."""
    config = PrefillEndpointConfig(me=PREFILL, max_finished_room_ids=REMEMBERED)
    p = PrefillEndpoint(config)
    rooms = iter(range(10**6, 10**9, 7919))  # spread like random ids, never repeated
    for _ in range(2 * REMEMBERED):  # warm-up: the marks are full
        succeed_and_clear(p, next(rooms), 0.0)
    warm = retained_bytes(p)
    for _ in range(DISTINCT_ROOMS):
        succeed_and_clear(p, next(rooms), 1.0)
    after = retained_bytes(p)
    print(f"warm {warm} B, +{DISTINCT_ROOMS} distinct room ids {after} B, "
          f"{len(p.opened)} marks, {p.opened.forgotten} forgotten")  # fmt: skip
    assert after - warm <= SLACK_BYTES
    assert len(p.opened) == REMEMBERED and not p.rooms and not p.draining
    assert p.snapshot().pending == 0
    # A late ABORT for the first room id (forgotten long ago): ACKed, and its cancel is one
    # pending record under max_pending_room_ids, not a write.
    step = p.handle(abort(10**6, 0), 2.0)
    assert [type(o.message) for o in step.outputs if isinstance(o, SendMessage)] == [AbortAck]
    assert p.snapshot().pending == 1


def test_a_room_id_that_still_holds_something_keeps_its_mark() -> None:
    """Forgetting skips a room id the rank still hosts: its mark decides which of its
    generations a late message belongs to, so a stale message for it stays stale."""
    p = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, max_finished_room_ids=2))
    p.handle(OpenRoom(1, 5), 0.0)  # stays open throughout
    for room in range(100, 110):
        succeed_and_clear(p, room, 0.0)
    assert 1 in p.opened and len(p.opened) == 2
    meta = RoomMetadata(room=1, generation=4, decode=DECODE, prefill=PREFILL, session_id="s",
                        dst_pages=(7,), aux_index=None, required_dst_info_num=1)  # fmt: skip
    step = p.handle(Received(meta), 1.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["stale_generation"]


def test_the_room_id_being_opened_keeps_its_mark_when_every_other_one_is_held() -> None:
    """With max_finished_room_ids room ids held, the next one to open was the only one left
    to forget, and its mark went as it opened (it is hosted only after the mark is raised):
    a stale message for its older generation then read as new, and was parked."""
    p = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, max_finished_room_ids=2))
    for room in (1, 2, 3):  # all stay open
        p.handle(OpenRoom(room, 5), 0.0)
    assert all(p.opened.get(room) == 5 for room in (1, 2, 3))
    meta = RoomMetadata(room=3, generation=4, decode=DECODE, prefill=PREFILL, session_id="s",
                        dst_pages=(7,), aux_index=None, required_dst_info_num=1)  # fmt: skip
    step = p.handle(Received(meta), 1.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["stale_generation"]
    assert p.snapshot().pending == 0
