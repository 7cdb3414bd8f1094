"""Room lifecycles driven by inputs and a virtual clock (no I/O, no real time)."""

from __future__ import annotations

import msgspec
import pytest

from pdflow.core.framework.errors import InvalidInput, LocalProtocolError, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import (
    AbortRequested,
    ChecksumResult,
    FailureArrived,
    InitTransfer,
    MetadataArrived,
    PrefillCompleted,
    PublishPages,
    ReadyArrived,
    SendChunk,
    SuccessArrived,
    Tick,
)
from pdflow.core.protocol.messages import AbortAck, BootstrapRequest, RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import (
    ArmFence,
    SendMessage,
    StartTransfer,
    StatusChanged,
    StoreAux,
    VerifyChecksums,
)
from pdflow.core.protocol.policy import AllocationPolicy
from pdflow.core.rooms.receiver_room import ReceiverRoom, ReceiverState
from pdflow.core.rooms.sender_room import SenderRoom, SenderState
from tests.unit.room_fixtures import (
    AUX,
    DECODE,
    DECODE_B,
    GEN,
    PREFILL,
    PREFILL_B,
    PUBLISH,
    ROOM,
    abort,
    completed,
    metadata,
    new_receiver,
    new_sender,
    resolved,
    sender_in,
)

PC = AllocationPolicy.PREFILL_COMPLETE


def sent(step, kind):  # type: ignore[no-untyped-def]
    return [o.message for o in step.outputs
            if isinstance(o, SendMessage) and isinstance(o.message, kind)]


def polls(step):  # type: ignore[no-untyped-def]
    return [o.poll for o in step.outputs if isinstance(o, StatusChanged)]


# ---- happy paths, both policies ------------------------------------------------------------------
def test_early_policy_happy_path() -> None:
    receiver, sender = new_receiver(), new_sender()
    assert polls(receiver.handle(resolved(), 1.0)) == [KVPoll.WaitingForInput]
    step = receiver.handle(PUBLISH, 2.0)
    [md] = sent(step, RoomMetadata)
    assert polls(step) == [KVPoll.Transferring]
    assert polls(sender.handle(MetadataArrived(md), 2.1)) == [KVPoll.WaitingForInput]
    sender.handle(InitTransfer(3, aux_index=5), 3.0)
    first = sender.handle(SendChunk((7, 8), False), 3.0)
    [write1] = [o for o in first.outputs if isinstance(o, StartTransfer)]
    assert write1.dst_pages == (100, 101) and not write1.is_last
    assert write1.src_aux_index is None, "the aux row travels with the last chunk only"
    last = sender.handle(SendChunk((9,), True), 3.1)
    [write2] = [o for o in last.outputs if isinstance(o, StartTransfer)]
    assert write2.dst_pages == (102,) and write2.is_last and write2.aux_index == 3
    assert write2.src_aux_index == 5
    assert sender.handle(completed(write1.seq, checksum=5), 3.2).outputs == ()
    done = sender.handle(completed(write2.seq, checksum=6, aux=AUX), 3.3)
    [status] = sent(done, StatusReport)
    assert status.status is KVPoll.Success and status.checksum == 11 and status.aux == AUX
    assert sender.poll is KVPoll.Success
    final = receiver.handle(SuccessArrived(status.prefill, status.checksum, status.aux), 3.4)
    assert polls(final) == [KVPoll.Success] and receiver.poll is KVPoll.Success
    # The row is in the decode's slot before the Success the same step reports.
    assert [type(o).__name__ for o in final.outputs] == ["StoreAux", "StatusChanged"]
    assert final.outputs[0] == StoreAux(ROOM, GEN, 3, AUX)


def test_a_room_with_an_aux_slot_fails_without_its_aux_row() -> None:
    receiver = new_receiver()
    receiver.handle(resolved(), 1.0)
    receiver.handle(PUBLISH, 2.0)
    step = receiver.handle(SuccessArrived(PREFILL), 3.0)
    assert polls(step) == [KVPoll.Failed]
    assert not [o for o in step.outputs if isinstance(o, StoreAux)]
    assert "aux row" in receiver.reason and "init_transfer" in receiver.reason


def test_an_aux_row_of_the_wrong_size_fails_the_room() -> None:
    receiver = new_receiver()
    receiver.aux_row_bytes = len(AUX) + 1
    receiver.handle(resolved(), 1.0)
    receiver.handle(PUBLISH, 2.0)
    assert polls(receiver.handle(SuccessArrived(PREFILL, aux=AUX), 3.0)) == [KVPoll.Failed]
    assert f"{len(AUX)}-byte aux row" in receiver.reason


def test_the_prefill_refuses_init_without_the_aux_row_its_decode_expects() -> None:
    receiver, sender = new_receiver(), new_sender()
    receiver.handle(resolved(), 1.0)
    [md] = sent(receiver.handle(PUBLISH, 2.0), RoomMetadata)
    sender.handle(MetadataArrived(md), 2.1)
    with pytest.raises(InvalidInput, match="aux_index"):
        sender.handle(InitTransfer(3), 3.0)
    assert sender.num_pages is None, "a refused call changes nothing"


@pytest.mark.parametrize("state", [SenderState.WAITING_FOR_INPUT, SenderState.FAILED],
                         ids=lambda s: s.name)  # fmt: skip
@pytest.mark.parametrize(
    "call",
    [InitTransfer(-1, aux_index=0), InitTransfer(2, aux_index=-1), InitTransfer(2**63)],
    ids=["negative num_pages", "negative aux_index", "num_pages past 2**63 - 1"],
)  # fmt: skip
def test_invalid_init_arguments_are_refused_in_every_state_that_takes_the_call(
    state: SenderState, call: InitTransfer
) -> None:
    # A failed room took InitTransfer(-1) without a word: only WAITING_FOR_INPUT validated it.
    sender = sender_in(state)
    before = (sender.state, sender.num_pages, sender.aux_index, sender.reason)
    with pytest.raises(InvalidInput, match=r"outside \[0, 2\*\*63 - 1\]"):
        sender.handle(call, 2.0)
    assert (sender.state, sender.num_pages, sender.aux_index, sender.reason) == before


CHUNK_TAKING_STATES = [SenderState.WAITING_FOR_INPUT, SenderState.TRANSFERRING,
                       SenderState.DRAINING, SenderState.FAILED]  # fmt: skip


@pytest.mark.parametrize("state", CHUNK_TAKING_STATES, ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("chunk", "why"),
    [
        (SendChunk((0,), is_last=False, state_indices=((1,),)), "last chunk only"),
        (SendChunk((0, -1), is_last=True), "source page -1 is outside"),
        (SendChunk((0,), is_last=True, state_indices=((2**63,),)),
         f"state index {2**63} is outside"),
    ],
    ids=["state indices on a chunk not last", "negative source page", "state index past range"],
)  # fmt: skip
def test_invalid_chunk_arguments_are_refused_in_every_state_that_takes_the_call(
    state: SenderState, chunk: SendChunk, why: str
) -> None:
    # Only a room expecting a chunk checked them: a draining or failed room took them silently,
    # and no state refused a source page -1 (a write from below the engine's KV buffer).
    sender = sender_in(state)
    before = (sender.state, sender.next_page, sender.last_submitted, dict(sender.outstanding))
    with pytest.raises(InvalidInput, match=why):
        sender.handle(chunk, 2.0)
    assert (sender.state, sender.next_page, sender.last_submitted,
            dict(sender.outstanding)) == before  # fmt: skip


def test_the_sender_tells_the_engine_the_decodes_prefix_and_its_peers_must_agree() -> None:
    sender = new_sender()
    first = msgspec.structs.replace(metadata(DECODE, required=2), decode_prefix_len=32)
    sender.handle(MetadataArrived(first), 1.0)
    assert sender.decode_prefix_len == 32
    other = msgspec.structs.replace(metadata(DECODE_B, required=2), decode_prefix_len=16)
    with pytest.raises(RemoteProtocolError, match="disagree on decode_prefix_len"):
        sender.handle(MetadataArrived(other), 1.1)
    assert set(sender.peers) == {DECODE}, "the refused metadata changed nothing"


def test_prefill_complete_policy_happy_path() -> None:
    receiver, sender = new_receiver(PC), new_sender(PC)
    step = receiver.handle(resolved(), 1.0)
    assert sent(step, BootstrapRequest) and receiver.state is ReceiverState.AWAITING_READY
    assert receiver.poll is KVPoll.Bootstrapping
    assert sender.timer_at() is None, "bootstrap clock starts only when the prefill completes"
    sender.handle(PrefillCompleted(), 50.0)
    assert sender.timer_at() == 350.0
    assert polls(receiver.handle(ReadyArrived(PREFILL), 60.0)) == [KVPoll.WaitingForInput]
    [md] = sent(receiver.handle(PUBLISH, 61.0), RoomMetadata)
    sender.handle(MetadataArrived(md), 61.0)
    sender.handle(InitTransfer(3, aux_index=0), 61.0)
    [write] = [o for o in sender.handle(SendChunk((1, 2, 3), True), 61.0).outputs
               if isinstance(o, StartTransfer)]
    [status] = sent(sender.handle(completed(write.seq, aux=AUX), 62.0), StatusReport)
    receiver.handle(SuccessArrived(status.prefill, aux=status.aux), 62.0)
    assert receiver.poll is KVPoll.Success and sender.poll is KVPoll.Success


# ---- timeouts: just before and exactly at the deadline -------------------------------------------
def refused_early(room: SenderRoom | ReceiverRoom, now: float) -> None:
    """An endpoint ticks a room only once its deadline is due: a Tick before it (or in a state
    without a deadline) is a caller bug, refused without a change."""
    before = (room.state, room.timer_at(), room.reason)
    with pytest.raises(LocalProtocolError):
        room.handle(Tick(), now)
    assert (room.state, room.timer_at(), room.reason) == before


def test_sender_bootstrap_timeout_early_policy() -> None:
    sender = new_sender(now=10.0)
    refused_early(sender, 309.999)
    assert sender.state is SenderState.BOOTSTRAPPING
    sender.handle(Tick(), 310.0)
    assert sender.state is SenderState.FAILED and "Bootstrapping" in sender.reason


def test_sender_bootstrap_timeout_prefill_complete_counts_from_completion() -> None:
    sender = new_sender(PC, now=0.0)
    refused_early(sender, 1000.0)
    assert sender.state is SenderState.BOOTSTRAPPING, "queue and compute time are not counted"
    sender.handle(PrefillCompleted(), 1000.0)
    refused_early(sender, 1299.999)
    assert sender.state is SenderState.BOOTSTRAPPING
    sender.handle(Tick(), 1300.0)
    assert sender.state is SenderState.FAILED


def test_receiver_waiting_timeout_while_bootstrapping() -> None:
    receiver = new_receiver(now=5.0)
    refused_early(receiver, 304.999)
    assert receiver.state is ReceiverState.BOOTSTRAPPING
    receiver.handle(Tick(), 305.0)
    assert receiver.poll is KVPoll.Failed and "waiting for the prefill" in receiver.reason


def test_receiver_waiting_timeout_for_ready_then_abort() -> None:
    receiver = new_receiver(PC)
    receiver.handle(resolved(), 100.0)
    refused_early(receiver, 399.999)
    assert receiver.state is ReceiverState.AWAITING_READY
    step = receiver.handle(Tick(), 400.0)
    assert receiver.poll is KVPoll.Failed and sent(step, type(abort().abort))


@pytest.mark.invariant("single_room_status_clock")
def test_ready_resets_the_waiting_clock() -> None:
    receiver = new_receiver(PC)
    receiver.handle(resolved(), 0.0)
    receiver.handle(ReadyArrived(PREFILL), 250.0)
    assert receiver.timer_at() == 550.0
    refused_early(receiver, 549.999)
    assert receiver.state is ReceiverState.AWAITING_PAGES
    receiver.handle(Tick(), 550.0)
    assert receiver.poll is KVPoll.Failed


@pytest.mark.invariant("single_room_status_clock")
def test_transfer_budget_is_a_separate_clock_started_at_publish() -> None:
    receiver = new_receiver()
    receiver.handle(resolved(), 0.0)
    assert receiver.timer_at() is None, "early policy: waiting for memory is admission's job"
    refused_early(receiver, 10_000.0)
    assert receiver.state is ReceiverState.AWAITING_PAGES
    receiver.handle(PUBLISH, 10_000.0)
    refused_early(receiver, 10_299.999)
    assert receiver.state is ReceiverState.TRANSFERRING
    step = receiver.handle(Tick(), 10_300.0)
    assert receiver.poll is KVPoll.Failed
    fence = [o for o in step.outputs if isinstance(o, ArmFence)]
    assert fence and step.outputs.index(fence[0]) < next(
        i for i, o in enumerate(step.outputs) if isinstance(o, SendMessage)
    ), "the fence is armed before any ABORT leaves"


# ---- failure ordering, duplicates, several peers -----------------------------------------------
@pytest.mark.invariant("failed_absorbing")
def test_failure_beats_a_late_ready() -> None:
    receiver = new_receiver(PC)
    receiver.handle(resolved(), 0.0)
    receiver.handle(FailureArrived(PREFILL, "prefill aborted"), 1.0)
    step = receiver.handle(ReadyArrived(PREFILL), 2.0)
    assert receiver.poll is KVPoll.Failed and step.outputs == ()


@pytest.mark.invariant("success_needs_all_peers")
def test_success_needs_the_last_distinct_peer_and_duplicates_do_not_count() -> None:
    receiver = new_receiver()
    receiver.handle(resolved(PREFILL, PREFILL_B), 0.0)
    receiver.handle(PUBLISH, 0.0)
    receiver.handle(SuccessArrived(PREFILL, aux=AUX), 1.0)
    receiver.handle(SuccessArrived(PREFILL, aux=AUX), 1.5)
    assert receiver.poll is KVPoll.Transferring, "a duplicate report counts once"
    receiver.handle(SuccessArrived(PREFILL_B, aux=AUX), 2.0)
    assert receiver.poll is KVPoll.Success


@pytest.mark.invariant("success_needs_all_peers")
def test_sender_waits_for_every_required_decode_peer() -> None:
    sender = new_sender()
    sender.handle(MetadataArrived(metadata(DECODE, required=2)), 0.0)
    sender.handle(MetadataArrived(metadata(DECODE, required=2)), 0.1)
    assert sender.poll is KVPoll.Bootstrapping, "the same decode peer twice is one peer"
    sender.handle(MetadataArrived(metadata(DECODE_B, required=2)), 0.2)
    assert sender.poll is KVPoll.WaitingForInput
    sender.handle(InitTransfer(4, aux_index=0), 1.0)
    step = sender.handle(SendChunk((1, 2, 3, 4), True), 1.0)
    writes = [o for o in step.outputs if isinstance(o, StartTransfer)]
    assert {w.peer for w in writes} == {DECODE, DECODE_B}
    sender.handle(completed(writes[0].seq), 2.0)
    assert sender.poll is KVPoll.Transferring
    sender.handle(completed(writes[1].seq), 2.0)
    assert sender.poll is KVPoll.Success


@pytest.mark.invariant("terminal_sticky", "failed_absorbing")
def test_terminal_states_are_sticky() -> None:
    receiver = new_receiver()
    receiver.handle(resolved(), 0.0)
    receiver.handle(PUBLISH, 0.0)
    receiver.handle(SuccessArrived(PREFILL, aux=AUX), 1.0)
    with pytest.raises(RemoteProtocolError):
        receiver.handle(FailureArrived(PREFILL, "a failure after Success is a peer bug"), 1.5)
    receiver.handle(AbortRequested("too late"), 2.0)
    refused_early(receiver, 10_000.0)
    assert receiver.poll is KVPoll.Success


@pytest.mark.invariant("checksums_fail_closed")
def test_checksum_mismatch_fails_closed() -> None:
    receiver = new_receiver(verify=True)
    receiver.handle(resolved(), 0.0)
    receiver.handle(PUBLISH, 0.0)
    receiver.handle(SuccessArrived(PREFILL, 1234, AUX), 1.0)
    assert receiver.poll is KVPoll.Transferring, "Success waits for verification"
    receiver.handle(ChecksumResult(False, "page 101 differs"), 1.1)
    assert receiver.poll is KVPoll.Failed and "page 101 differs" in receiver.reason


@pytest.mark.invariant("checksums_fail_closed")
def test_finding3_missing_checksum_fails_closed() -> None:
    """Issue 12, finding 3: with the decode's checksum on and a writer sending none, the room
    used to end Success unverified (the writer was left out of the verification)."""
    receiver = new_receiver(require=True)
    receiver.handle(resolved(PREFILL, PREFILL_B), 0.0)
    receiver.handle(PUBLISH, 0.0)
    assert receiver.handle(SuccessArrived(PREFILL, 1234, AUX), 1.0).outputs == ()
    step = receiver.handle(SuccessArrived(PREFILL_B, aux=AUX), 1.1)
    assert receiver.poll is KVPoll.Failed
    assert not any(isinstance(o, VerifyChecksums) for o in step.outputs)
    assert receiver.reason.startswith("KV checksum missing")
    assert f"{PREFILL_B.address}#{PREFILL_B.rank}" in receiver.reason
    assert f"{PREFILL.address}#{PREFILL.rank}" not in receiver.reason
    assert "PDFLOW_CHECKSUM=1" in receiver.reason


def test_staged_room_without_required_checksums_still_verifies_what_it_got() -> None:
    receiver = new_receiver(verify=True)
    receiver.handle(resolved(PREFILL, PREFILL_B), 0.0)
    receiver.handle(PUBLISH, 0.0)
    receiver.handle(SuccessArrived(PREFILL, 1234, AUX), 1.0)
    (verify,) = receiver.handle(SuccessArrived(PREFILL_B, aux=AUX), 1.1).outputs
    assert isinstance(verify, VerifyChecksums) and verify.expected == ((PREFILL, 1234),)
    assert receiver.state is ReceiverState.VERIFYING


# ---- abort with drain --------------------------------------------------------------------------
@pytest.mark.invariant("drain_before_ack")
def test_abort_drains_before_ack_and_acks_every_peer_once() -> None:
    sender = new_sender()
    sender.handle(MetadataArrived(metadata(DECODE, required=2)), 0.0)
    sender.handle(MetadataArrived(metadata(DECODE_B, required=2)), 0.0)
    sender.handle(InitTransfer(4, aux_index=0), 0.0)
    writes = [o for o in sender.handle(SendChunk((1, 2), False), 0.0).outputs
              if isinstance(o, StartTransfer)]
    step = sender.handle(abort(DECODE), 1.0)
    assert sender.poll is KVPoll.Failed and sender.state is SenderState.DRAINING
    assert not sent(step, AbortAck), "no ACK while writes are outstanding"
    assert sender.handle(SendChunk((3, 4), True), 1.1).outputs == (), "no new write after abort"
    assert not sent(sender.handle(completed(writes[0].seq), 2.0), AbortAck)
    acks = sent(sender.handle(completed(writes[1].seq, False, "late"), 3.0), AbortAck)
    assert sorted(a.decode.address for a in acks) == sorted([DECODE.address, DECODE_B.address])
    assert sender.state is SenderState.FAILED
    assert len(sent(sender.handle(abort(DECODE_B), 4.0), AbortAck)) == 1, "quiescent: ACK now"


@pytest.mark.invariant("chunks_partition")
def test_bad_chunks_are_refused_without_change() -> None:
    sender = new_sender()
    sender.handle(MetadataArrived(metadata()), 0.0)
    with pytest.raises(LocalProtocolError):
        sender.handle(SendChunk((1,), False), 0.0)
    sender.handle(InitTransfer(2, aux_index=0), 0.0)
    with pytest.raises(InvalidInput, match="exactly the chunk reaching num_pages is last"):
        sender.handle(SendChunk((1, 2), False), 0.0)
    with pytest.raises(InvalidInput):
        sender.handle(SendChunk((1, 2, 3), True), 0.0)
    assert sender.next_page == 0 and sender.state is SenderState.WAITING_FOR_INPUT


def test_pages_published_for_another_room_are_refused_and_change_nothing() -> None:
    receiver = new_receiver()
    receiver.handle(resolved(), 0.0)
    assert receiver.state is ReceiverState.AWAITING_PAGES
    with pytest.raises(InvalidInput, match="pages published for room"):
        receiver.handle(PublishPages(PUBLISH.room + 1, PUBLISH.dst_pages, 3), 1.0)
    assert receiver.state is ReceiverState.AWAITING_PAGES and receiver.published is None
    [md] = sent(receiver.handle(PUBLISH, 2.0), RoomMetadata)
    assert md.session_id == DECODE.address and md.dst_pages == PUBLISH.dst_pages
