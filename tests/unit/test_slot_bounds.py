"""Bounded state (docs/architecture.md, "Bounded state"): what a prefill endpoint keeps per room
id does not grow with failures or stray messages. Invariant: bounded_room_state.

Measured as a size bound, not a timing: the retained size of the endpoint (every object it
reaches) after 100,000 failed-and-cleared generations, and again after 100,000 stray ABORTs,
equals its size after a short warm-up to within a few KiB.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    OpenRoom,
    PrefillEndpointConfig,
    Received,
    RoomCall,
    TimerFired,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.protocol.inputs import AbortRequested
from pdflow.core.protocol.messages import Abort, AbortAck, PeerId
from pdflow.core.protocol.outputs import SendMessage
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
    assert acked == STRAY  # every one is answered; none is kept
    assert after_failures - warm <= SLACK_BYTES
    assert after_stray - warm <= SLACK_BYTES
    assert p.snapshot().pending == 0 and not p.rooms and not p.draining
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
