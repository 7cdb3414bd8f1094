"""Dummy peers (MLA fan-out, one writer per DP group) take part in a room but never write."""

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import (
    InitTransfer,
    MetadataArrived,
    PeersResolved,
    PrefillTarget,
    SendChunk,
    SuccessArrived,
)
from pdflow.core.protocol.outputs import StartTransfer
from tests.unit.room_fixtures import (
    DECODE,
    DECODE_B,
    PREFILL,
    PREFILL_B,
    PUBLISH,
    metadata,
    new_receiver,
    new_sender,
)


def test_a_sender_writes_to_its_writing_peers_only() -> None:
    room = new_sender()
    room.fire(MetadataArrived(metadata(DECODE, required=2)), 1.0)
    room.fire(MetadataArrived(metadata(DECODE_B, required=2, dummy=True)), 1.0)
    room.fire(InitTransfer(4, aux_index=5), 1.0)
    outputs, _ = room.fire(SendChunk((0, 1, 2, 3), is_last=True), 1.0)
    writes = [o for o in outputs if isinstance(o, StartTransfer)]
    assert [w.peer for w in writes] == [DECODE]


def test_a_dummy_prefill_rank_success_does_not_complete_a_receiver() -> None:
    room = new_receiver()
    targets = (PrefillTarget(PREFILL), PrefillTarget(PREFILL_B, is_dummy=True))
    room.fire(PeersResolved(targets, required_responses=1), 1.0)
    assert room.writers == (PREFILL,)
    room.fire(PUBLISH, 1.0)
    room.fire(SuccessArrived(PREFILL_B, aux=b"x"), 1.0)
    assert room.poll is KVPoll.Transferring and not room.succeeded
    room.fire(SuccessArrived(PREFILL, aux=b"x"), 1.0)
    assert room.poll is KVPoll.Success and room.aux == b"x"
