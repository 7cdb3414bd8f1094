"""Room slots: which generation of a room id each message belongs to (issue 11, bugs A, B, C).

Each bug test drives real endpoints (both sides where it matters) through the story an
independent user reported, and fails under its mutant in pdflow.sim.mutants.
"""

from __future__ import annotations

import msgspec
import pytest

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    DecodeEndpointConfig,
    Dropped,
    OpenReceiver,
    OpenRoom,
    PrefillEndpointConfig,
    PrefillInfo,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    TimerFired,
    TopologyKnown,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.errors import ProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import (
    AbortRequested,
    InitTransfer,
    PrefillCompleted,
    PublishPages,
    SendChunk,
    TransferCompleted,
)
from pdflow.core.protocol.messages import (
    Abort,
    AbortAck,
    BootstrapRequest,
    PeerId,
    RoomMetadata,
    StatusReport,
)
from pdflow.core.protocol.outputs import SendMessage, StartTransfer, StatusChanged
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts

PC = AllocationPolicy.PREFILL_COMPLETE
PREFILL = PeerId("127.0.0.1:7000", "p1", 0)
DECODE = PeerId("127.0.0.1:8000", "d1", 0)
BOOT = "127.0.0.1:8998"
TIMEOUTS = Timeouts(bootstrap_timeout=300.0, waiting_timeout=300.0)


def prefill(policy: AllocationPolicy = AllocationPolicy.EARLY) -> PrefillEndpoint:
    return PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, policy=policy, timeouts=TIMEOUTS))


def decode(policy: AllocationPolicy) -> DecodeEndpoint:
    decode = DecodeEndpoint(
        DecodeEndpointConfig(me=DECODE, num_pages=32, policy=policy, timeouts=TIMEOUTS)
    )
    return decode


def topology(policy: AllocationPolicy) -> TopologyKnown:
    return TopologyKnown(
        PrefillInfo(
            bootstrap=BOOT, tp_size=1, cp_size=1, pp_size=1, dp_size=1, page_size=16,
            kv_cache_dtype="auto", policy=policy,
            ranks=(RegisteredPrefillRank(0, 0, 0, 0, PREFILL),),
        )
    )  # fmt: skip


def metadata(room: int, generation: int, pages: tuple[int, ...] = (4, 5)) -> RoomMetadata:
    return RoomMetadata(
        room=room, generation=generation, decode=DECODE, prefill=PREFILL, session_id="s",
        dst_pages=pages, aux_index=0, required_dst_info_num=1,
    )  # fmt: skip


def abort(room: int, generation: int) -> Abort:
    return Abort(room=room, generation=generation, decode=DECODE, prefill=PREFILL, reason="x")


def messages(step: Step, kind: type) -> list:
    return [o.message for o in step.outputs if isinstance(o, SendMessage)
            and isinstance(o.message, kind)]  # fmt: skip


def dropped(step: Step) -> list[str]:
    return [o.kind for o in step.outputs if isinstance(o, Dropped)]


def polls(step: Step) -> list[KVPoll]:
    return [o.poll for o in step.outputs if isinstance(o, StatusChanged)]


def deliver(step: Step, to: PrefillEndpoint | DecodeEndpoint, now: float) -> list[Step]:
    sent = [o.message for o in step.outputs if isinstance(o, SendMessage)]
    return [to.handle(Received(m), now) for m in sent]


def draining_prefill(room: int = 3) -> tuple[PrefillEndpoint, int]:
    """Generation 1 of ``room`` failed with a write in flight, and the engine cleared it."""
    p = prefill()
    p.handle(OpenRoom(room, 1), 0.0)
    p.handle(Received(metadata(room, 1)), 0.0)
    p.handle(RoomCall(room, InitTransfer(2, aux_index=0)), 0.0)
    step = p.handle(RoomCall(room, SendChunk((10, 11), is_last=True)), 0.0)
    (write,) = [o for o in step.outputs if isinstance(o, StartTransfer)]
    assert polls(p.handle(RoomCall(room, AbortRequested("engine gave up")), 1.0)) == [KVPoll.Failed]
    p.handle(ClearRoom(room), 1.0)
    assert room not in p.rooms and (room, 1) in p.draining
    return p, write.seq


# ---- A: a failed room id refuses its next generation (prefill_complete) -----------------------
@pytest.mark.invariant("generation_isolation")
def test_failed_room_id_accepts_next_generation_under_prefill_complete() -> None:
    """Bug A: generation 1 of room 9 fails and both sides clear. Generation 2's BOOTSTRAP must
    be taken (not dropped as "the room is at generation 1") and OpenRoom(9, 2) must not fail
    with "Duplicate or cancelled bootstrap room"; the decode gets its ready signal at once."""
    p, d = prefill(PC), decode(PC)
    d.handle(TopologyKnown(topology(PC).info), 0.0)
    p.handle(OpenRoom(9, 1), 0.0)
    deliver(d.handle(OpenReceiver(9, 1, BOOT), 0.0), p, 0.0)
    for step in deliver(p.handle(RoomCall(9, AbortRequested("out of memory")), 1.0), d, 1.0):
        deliver(step, p, 1.0)  # the decode's answering ABORT, ACKed
    p.handle(ClearRoom(9), 2.0)
    d.handle(ClearRoom(9), 2.0)
    (bootstrap,) = messages(d.handle(OpenReceiver(9, 2, BOOT), 3.0), BootstrapRequest)
    assert dropped(p.handle(Received(bootstrap), 3.0)) == []
    opened = p.handle(OpenRoom(9, 2), 3.0)
    assert KVPoll.Failed not in polls(opened)
    (ready,) = messages(p.handle(RoomCall(9, PrefillCompleted()), 4.0), StatusReport)
    assert (ready.generation, ready.status) == (2, KVPoll.WaitingForInput)
    d.handle(Received(ready), 4.0)
    assert d.rooms[9].poll is KVPoll.WaitingForInput


@pytest.mark.invariant("generation_isolation", "bounded_room_state")
def test_late_abort_of_a_cleared_room_does_not_block_its_next_generation() -> None:
    """Bug A, second half: a late ABORT for a cleared room left a generation-less tombstone in
    the ready table, so the next generation failed at once. It is ACKed and kept nowhere."""
    p = prefill(PC)
    p.handle(OpenRoom(9, 1), 0.0)
    p.handle(RoomCall(9, AbortRequested("x")), 1.0)
    p.handle(ClearRoom(9), 1.0)
    assert messages(p.handle(Received(abort(9, 1)), 2.0), AbortAck)
    assert p.snapshot().pending == 0
    opened = p.handle(OpenRoom(9, 2), 3.0)
    assert KVPoll.Failed not in polls(opened)
    assert p.rooms[9].poll is KVPoll.Bootstrapping


# ---- B: a newer generation taken for a stale one ----------------------------------------------
@pytest.mark.invariant("newer_generation_not_stale")
def test_newer_generation_metadata_is_kept_while_the_older_one_drains() -> None:
    """Bug B: generation 1 still drains on the prefill (the engine cleared it). Generation 2's
    metadata was dropped as stale_generation, so the decode held its pages for 300 s. It is
    parked and serves generation 2 when the engine opens it, while generation 1 still drains."""
    p, seq = draining_prefill()
    assert dropped(p.handle(Received(metadata(3, 2, pages=(6, 7))), 2.0)) == []
    opened = p.handle(OpenRoom(3, 2), 3.0)
    assert polls(opened) == [KVPoll.WaitingForInput]
    drained = p.handle(TransferCompleted(3, 1, seq, ok=True), 4.0)
    assert p.rooms[3].generation == 2 and (3, 1) not in p.draining
    assert [o.generation for o in drained.outputs if hasattr(o, "generation")] == [1]


@pytest.mark.invariant("generation_isolation")
def test_the_older_generation_draining_its_last_write_keeps_the_newer_ones_timer() -> None:
    """Chaos finding 7 (seed 10): generation 1 still drains when generation 2 opens; its last
    write's completion re-armed the room id's one deadline with its own (none, being over), so
    generation 2 lost its bootstrap timer and waited for decode metadata for ever. Generation
    2 must still time out, and say why, at its own deadline."""
    p, seq = draining_prefill()
    p.handle(OpenRoom(3, 2), 2.0)
    p.handle(TransferCompleted(3, 1, seq, ok=False, reason="peer unreachable"), 2.5)
    assert (3, 1) not in p.draining and p.rooms[3].poll is KVPoll.Bootstrapping
    assert p.timer_at() == 2.0 + TIMEOUTS.bootstrap_timeout
    expired = p.handle(TimerFired(), 2.0 + TIMEOUTS.bootstrap_timeout)
    assert polls(expired) == [KVPoll.Failed]
    assert "waiting for decode metadata" in p.rooms[3].reason


@pytest.mark.invariant("abort_is_final", "newer_generation_not_stale")
def test_abort_for_a_newer_generation_is_final_while_the_older_one_is_open() -> None:
    """Bug B, the use-after-free: with generation 1 open, an ABORT for generation 2 was ACKed
    but not kept; a duplicated metadata frame then revived generation 2, which wrote into the
    pages the decode freed on that ACK. The cancel is kept: generation 2 opens Failed and the
    late metadata is dropped, so no write is ever started."""
    p = prefill()
    p.handle(OpenRoom(3, 1), 0.0)
    p.handle(Received(metadata(3, 2)), 0.5)
    assert messages(p.handle(Received(abort(3, 2)), 1.0), AbortAck)
    assert dropped(p.handle(Received(metadata(3, 2)), 2.0)) == ["aborted_room"]
    p.handle(RoomCall(3, AbortRequested("done")), 3.0)
    p.handle(ClearRoom(3), 3.0)
    assert polls(p.handle(OpenRoom(3, 2), 4.0)) == [KVPoll.Failed]
    p.handle(Received(metadata(3, 2)), 5.0)
    p.handle(RoomCall(3, InitTransfer(2, aux_index=0)), 5.0)
    step = p.handle(RoomCall(3, SendChunk((10, 11), is_last=True)), 5.0)
    assert not [o for o in step.outputs if isinstance(o, StartTransfer)]


# ---- C: state that grows with the failure count -----------------------------------------------
@pytest.mark.invariant("bounded_room_state")
def test_prefill_failures_cleared_promptly_leave_nothing_after_the_answering_abort() -> None:
    """Bug C: every prefill-side failure the engine cleared promptly left a permanent
    early-arrival entry when the decode's answering ABORT arrived (6,000 failures, 6,000
    entries). Now nothing is pending, whatever the count."""
    p = prefill()
    for generation in range(1, 201):
        p.handle(OpenRoom(5, generation), float(generation))
        p.handle(RoomCall(5, AbortRequested("prefill failed")), float(generation))
        p.handle(ClearRoom(5), float(generation))
        assert messages(p.handle(Received(abort(5, generation)), float(generation)), AbortAck)
    assert p.snapshot().pending == 0 and not p.rooms and not p.draining
    assert len(p.opened) == 1 and p.opened.get(5) == 200
    assert p.timer_at() is None
    p.handle(TimerFired(), 10_000.0)
    assert p.snapshot().pending == 0


# ---- an ACKed cancel outlives a newer generation and the forgetting of opened marks ------------
def fail_and_clear(p: PrefillEndpoint, room: int, generation: int, now: float) -> None:
    p.handle(OpenRoom(room, generation), now)
    p.handle(RoomCall(room, AbortRequested("engine gave up")), now)
    p.handle(ClearRoom(room), now)


def refused_open(p: PrefillEndpoint, room: int, generation: int, now: float) -> str:
    """Open an older generation: refused with a typed error that changes nothing."""
    before = msgspec.json.encode(p.snapshot())
    with pytest.raises(ProtocolError) as refused:
        p.handle(OpenRoom(room, generation), now)
    assert msgspec.json.encode(p.snapshot()) == before and room not in p.rooms
    return str(refused.value)


@pytest.mark.invariant("abort_is_final", "bounded_room_state")
def test_cancel_before_open_outlives_a_newer_generation_and_forgotten_marks() -> None:
    """Model checker seed 284 (max_finished_room_ids 1): the ABORT for generation 1 arrived
    before it opened and was ACKed; the engine opened generation 2 (the cancel was dropped, the
    promise left to the opened mark), which failed and was cleared; other room ids then pushed
    the mark out, and the engine's late open of generation 1 opened as new, free to write into
    the pages the decode freed on that ACK. The cancel is kept, so the mark is too, and the
    late open of generation 1 is refused."""
    p = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, max_finished_room_ids=1))
    assert messages(p.handle(Received(abort(1, 1)), 0.0), AbortAck)
    fail_and_clear(p, 1, 2, 1.0)
    for room in range(100, 105):
        fail_and_clear(p, room, 1, 2.0)
    assert p.opened.forgotten >= 4  # 100 to 103 (104, the last opened, is remembered)
    assert "OpenSlot" in refused_open(p, 1, 1, 3.0)
    assert p.opened.get(1) == 2 and p.pending[1].cancelled == 1
    assert dropped(p.handle(Received(metadata(1, 1)), 4.0)) == ["stale_generation"]


@pytest.mark.invariant("abort_is_final", "bounded_room_state")
def test_opening_the_highest_cancelled_generation_keeps_a_lower_one() -> None:
    """ABORTs for generations 3 and then 1 are ACKed before either opens; generation 3 opens
    (and fails at once). Generation 1's promise still stands: the record stays, keeping the
    mark through forgetting, and a late open of generation 1 is refused. A room id that had one
    cancelled generation, opened, keeps nothing (SGLang: one generation per room id)."""
    p = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, max_finished_room_ids=1))
    assert messages(p.handle(Received(abort(1, 3)), 0.0), AbortAck)
    assert messages(p.handle(Received(abort(1, 1)), 0.0), AbortAck)
    assert polls(p.handle(OpenRoom(1, 3), 1.0)) == [KVPoll.Failed]
    p.handle(ClearRoom(1), 1.0)
    for room in range(100, 105):
        fail_and_clear(p, room, 1, 2.0)
    refused_open(p, 1, 1, 3.0)
    assert p.snapshot().pending == 1
    assert messages(p.handle(Received(abort(7, 0)), 4.0), AbortAck)
    assert polls(p.handle(OpenRoom(7, 0), 5.0)) == [KVPoll.Failed]
    p.handle(ClearRoom(7), 5.0)
    assert 7 not in p.pending


@pytest.mark.invariant("abort_is_final", "bounded_room_state")
def test_late_abort_below_the_mark_outlives_forgotten_marks() -> None:
    """The stop-20 hole: the engine opened generation 2 of room 1 first (generation 1 still
    queued in its scheduler); the decode's ABORT for generation 1 arrived, below the opened
    mark, and was ACKed and kept nowhere: the decode freed its pages. Generation 2 finished and
    was cleared; other room ids then pushed room 1's mark out (max_finished_room_ids 1), so the
    engine's late open of generation 1 read as a new room id and opened, and a duplicated
    metadata frame of generation 1 made it write into the freed pages. The ACK must hold: the
    late open is refused, and no write of generation 1 ever starts."""
    p = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, max_finished_room_ids=1))
    p.handle(OpenRoom(1, 2), 0.0)  # the engine's scheduler took generation 2 first
    assert messages(p.handle(Received(abort(1, 1)), 1.0), AbortAck)
    p.handle(RoomCall(1, AbortRequested("done")), 2.0)
    p.handle(ClearRoom(1), 2.0)
    for room in range(100, 105):  # churn: other room ids open, fail and clear
        fail_and_clear(p, room, 1, 3.0)
    assert p.opened.forgotten >= 4  # 100 to 103 (104, the last opened, is remembered)
    assert "OpenSlot" in refused_open(p, 1, 1, 4.0)  # on main it opened, as a new room id
    assert dropped(p.handle(Received(metadata(1, 1)), 5.0)) == ["stale_generation"]


def test_the_reused_slot_reads_each_room_ids_own_record() -> None:
    # The endpoint re-points one slot per input: a room id's parked metadata must not be seen
    # by the next input, for another room id that holds no record.
    p = prefill()
    parked = p.handle(Received(metadata(1, 1)), 1.0)
    assert not dropped(parked) and 1 in p.pending
    opened = p.handle(OpenRoom(2, 1), 2.0)
    assert [f.target for f in opened.fired if f.machine == "PrefillRoomSlot"] == ["OPEN"]
    assert [f.source for f in opened.fired if f.machine == "PrefillRoomSlot"] == ["ABSENT"]
    summary = p.summary(2)
    assert summary is not None and summary.poll is KVPoll.Bootstrapping and summary.peers == 0
    assert p.pending[1].parked_generation == 1 and 2 not in p.pending
    # And the parked room id's own open still finds its metadata.
    p.handle(OpenRoom(1, 1), 3.0)
    first = p.summary(1)
    assert first is not None and first.poll is KVPoll.WaitingForInput and 1 not in p.pending


def test_the_reused_decode_slot_reads_each_room_afresh() -> None:
    # A status for a room id not open is dropped even right after an input for an open one.
    d = decode(AllocationPolicy.EARLY)
    d.handle(topology(AllocationPolicy.EARLY), 0.0)
    d.handle(OpenReceiver(1, 1, BOOT), 1.0)
    report = StatusReport(room=2, generation=1, status=KVPoll.Success, prefill=PREFILL,
                          decode=DECODE)  # fmt: skip
    step = d.handle(Received(report), 2.0)
    assert dropped(step) == ["unknown_room"]
    assert [f.source for f in step.fired] == ["ABSENT"]


def test_a_room_leaving_its_timed_states_disarms_its_deadline_on_both_ranks() -> None:
    # The endpoints skip disarming a room id that holds no deadline; one that holds one must
    # still be disarmed, or the step reports a deadline nothing waits for.
    p = prefill()
    assert p.handle(OpenRoom(1, 1), 1.0).timer_at == 1.0 + TIMEOUTS.bootstrap_timeout
    step = p.handle(Received(metadata(1, 1)), 2.0)
    assert polls(step) == [KVPoll.WaitingForInput]
    assert step.timer_at is None and 1 not in p.deadlines.armed
    d = decode(AllocationPolicy.EARLY)
    d.handle(topology(AllocationPolicy.EARLY), 0.0)
    d.handle(OpenReceiver(1, 1, BOOT), 1.0)
    assert d.handle(PublishPages(1, (4, 5), aux_index=None), 1.0).timer_at is not None
    report = StatusReport(room=1, generation=1, status=KVPoll.Success, prefill=PREFILL,
                          decode=DECODE)  # fmt: skip
    step = d.handle(Received(report), 2.0)
    assert polls(step) == [KVPoll.Success]
    assert step.timer_at is None and 1 not in d.deadlines.armed


@pytest.mark.invariant("no_core_error", "refusal_changes_nothing")
def test_parked_metadata_the_room_refuses_is_dropped_not_raised_to_the_engines_open() -> None:
    """Two decode peers' metadata for generation 1 arrive before the engine opens it, and they
    disagree on required_dst_info_num. The open hands both to the new room, which refuses the
    second: that peer message must be dropped and counted (as after the open), not raised out
    of the engine's OpenRoom after the room was opened, leaving the engine believing the open
    failed while the endpoint hosts the room and keeps an empty record armed."""
    p = prefill()
    other = PeerId("127.0.0.1:8001", "d1", 1)
    first = msgspec.structs.replace(metadata(5, 1), required_dst_info_num=2)
    second = msgspec.structs.replace(first, decode=other, required_dst_info_num=3)
    assert not dropped(p.handle(Received(first), 0.0))
    assert not dropped(p.handle(Received(second), 0.0))
    step = p.handle(OpenRoom(5, 1), 1.0)
    assert dropped(step) == ["protocol_error"]
    assert p.counters["dropped_protocol_error"] == 1
    opened = p.summary(5)
    assert opened is not None and opened.peers == 1
    assert 5 not in p.pending and 5 not in p.parking_deadlines.armed
    # The peer that agrees completes the room as if the other had come after the open.
    third = msgspec.structs.replace(first, decode=PeerId("127.0.0.1:8002", "d1", 2))
    assert polls(p.handle(Received(third), 1.0)) == [KVPoll.WaitingForInput]
