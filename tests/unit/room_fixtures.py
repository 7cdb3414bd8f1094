"""Builders that drive rooms into each state through their public inputs only."""

from __future__ import annotations

from pdflow.core.inputs import (
    AbortArrived,
    AbortRequested,
    ChecksumResult,
    FailureArrived,
    InitTransfer,
    Input,
    MetadataArrived,
    PagesPublished,
    PeerDied,
    PeersResolved,
    PrefillCompleted,
    PrefillTarget,
    ReadyArrived,
    ResolveFailed,
    SendChunk,
    SuccessArrived,
    Tick,
    TransferCompleted,
)
from pdflow.core.messages import Abort, PeerId, RoomMetadata
from pdflow.core.policy import AllocationPolicy, Timeouts
from pdflow.core.receiver_room import ReceiverRoom, ReceiverState
from pdflow.core.sender_room import SenderRoom, SenderState

ROOM = 42
GEN = 7
PREFILL = PeerId("10.0.0.1:7000", "p-inc", 0)
PREFILL_B = PeerId("10.0.0.1:7001", "p-inc", 1)
DECODE = PeerId("10.0.0.2:8000", "d-inc", 0)
DECODE_B = PeerId("10.0.0.2:8001", "d-inc", 1)
TIMEOUTS = Timeouts(bootstrap_timeout=300.0, waiting_timeout=300.0)


def metadata(decode: PeerId = DECODE, *, required: int = 1, pages: int = 4,
             dummy: bool = False) -> RoomMetadata:
    return RoomMetadata(
        room=ROOM, generation=GEN, decode=decode, prefill=PREFILL, session_id=decode.address,
        dst_pages=() if dummy else tuple(range(100, 100 + pages)),
        aux_index=None if dummy else 3, required_dst_info_num=required, is_dummy=dummy,
    )


def abort(decode: PeerId = DECODE) -> AbortArrived:
    return AbortArrived(Abort(room=ROOM, generation=GEN, decode=decode, prefill=PREFILL))


def new_sender(policy: AllocationPolicy = AllocationPolicy.EARLY, now: float = 0.0) -> SenderRoom:
    return SenderRoom(ROOM, GEN, PREFILL, now, policy=policy, timeouts=TIMEOUTS)


def sender_in(state: SenderState) -> SenderRoom:
    room = new_sender()
    recipes: dict[SenderState, list[Input]] = {
        SenderState.BOOTSTRAPPING: [MetadataArrived(metadata(required=2))],
        SenderState.WAITING_FOR_INPUT: [MetadataArrived(metadata())],
        SenderState.TRANSFERRING: [
            MetadataArrived(metadata()), InitTransfer(4), SendChunk((1, 2), False),
            SendChunk((3,), False),
        ],
        SenderState.SUCCESS: [
            MetadataArrived(metadata()), InitTransfer(1), SendChunk((1,), True),
            TransferCompleted(0, True),
        ],
        SenderState.DRAINING: [
            MetadataArrived(metadata()), InitTransfer(4), SendChunk((1, 2), False),
            SendChunk((3,), False), abort(),
        ],
        SenderState.FAILED: [MetadataArrived(metadata()), AbortRequested("test")],
    }
    for inp in recipes[state]:
        room.handle(inp, 1.0)
    assert room.state is state, (state, room.state)
    return room


def sender_samples(room: SenderRoom) -> dict[str, list[Input]]:
    """For each input name, setup steps (same state) followed by the input under test."""
    first_seq = min(room.outstanding, default=0)
    needs_init = room.num_pages is None and room.state is SenderState.WAITING_FOR_INPUT
    init: list[Input] = [InitTransfer(4)] if needs_init else []
    pages = room.num_pages if room.num_pages is not None else 4
    chunk = SendChunk((9,), room.next_page + 1 == pages)
    return {
        "MetadataArrived": [MetadataArrived(metadata(DECODE_B, required=2))]
        if room.state is SenderState.BOOTSTRAPPING
        else [MetadataArrived(metadata())],
        "InitTransfer": [InitTransfer(4)],
        "SendChunk": [*init, chunk],
        "TransferCompleted": [TransferCompleted(first_seq, True)],
        "AbortArrived": [abort()],
        "AbortRequested": [AbortRequested("test")],
        "PrefillCompleted": [PrefillCompleted()],
        "Tick": [Tick()],
    }


def new_receiver(
    policy: AllocationPolicy = AllocationPolicy.EARLY, *, verify: bool = False, now: float = 0.0
) -> ReceiverRoom:
    return ReceiverRoom(ROOM, GEN, DECODE, now, policy=policy, timeouts=TIMEOUTS,
                        verify_checksums=verify)


def resolved(*peers: PeerId, required: int | None = None) -> PeersResolved:
    targets = tuple(PrefillTarget(p) for p in (peers or (PREFILL,)))
    return PeersResolved(targets, required if required is not None else len(targets))


PUBLISH = PagesPublished("10.0.0.2:8000", (100, 101, 102), 3)


def receiver_in(state: ReceiverState) -> ReceiverRoom:
    pc = AllocationPolicy.PREFILL_COMPLETE
    policy = pc if state is ReceiverState.AWAITING_READY else AllocationPolicy.EARLY
    room = new_receiver(policy, verify=state is ReceiverState.VERIFYING)
    recipes: dict[ReceiverState, list[Input]] = {
        ReceiverState.BOOTSTRAPPING: [],
        ReceiverState.AWAITING_READY: [resolved()],
        ReceiverState.AWAITING_PAGES: [resolved()],
        ReceiverState.TRANSFERRING: [resolved(PREFILL, PREFILL_B), PUBLISH],
        ReceiverState.VERIFYING: [resolved(), PUBLISH, SuccessArrived(PREFILL, 5)],
        ReceiverState.SUCCESS: [resolved(), PUBLISH, SuccessArrived(PREFILL)],
        ReceiverState.FAILED: [ResolveFailed("test")],
    }
    for inp in recipes[state]:
        room.handle(inp, 1.0)
    assert room.state is state, (state, room.state)
    return room


def receiver_samples(room: ReceiverRoom) -> dict[str, list[Input]]:
    return {
        "PeersResolved": [resolved()],
        "ResolveFailed": [ResolveFailed("registry said 404")],
        "ReadyArrived": [ReadyArrived(PREFILL)],
        "PagesPublished": [PUBLISH],
        "SuccessArrived": [SuccessArrived(PREFILL)],
        "FailureArrived": [FailureArrived(PREFILL, "boom")],
        "PeerDied": [PeerDied(PREFILL)],
        "AbortRequested": [AbortRequested("test")],
        "ChecksumResult": [ChecksumResult(True)],
        "Tick": [Tick()],
    }
