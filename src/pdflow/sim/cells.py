"""Cell drives: every room state reached through public inputs, and every input offered there.

The simulated worlds reach most spec transitions; a few rows no world reaches through an
endpoint (``pdflow.sim.coverage.cell_only()`` says why). These drives build each room state from
its inputs alone and offer it every input, so together with the worlds every transition of the
protocol machines is exercised. Shipped with the simulator, so an embedding can reuse them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    ClearRoom,
    OpenRoom,
    PrefillEndpointConfig,
    Received,
    RoomCall,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.errors import ProtocolError
from pdflow.core.framework.table import Fired
from pdflow.core.protocol.inputs import (
    AbortArrived,
    AbortRequested,
    ChecksumResult,
    FailureArrived,
    InitTransfer,
    Input,
    MetadataArrived,
    PeerDied,
    PeersResolved,
    PrefillCompleted,
    PrefillTarget,
    PublishPages,
    ReadyArrived,
    ResolveFailed,
    SendChunk,
    StagingWait,
    SuccessArrived,
    Tick,
    TransferCompleted,
)
from pdflow.core.protocol.messages import Abort, PeerId, RoomMetadata
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts
from pdflow.core.resources.page_ledger import (
    AckArrived,
    Fence,
    LedgerInput,
    PageLedger,
    ReleaseAfterSuccess,
    ReleaseUnpublished,
    Reserve,
    SessionClosed,
    SessionRetired,
    VerifyDone,
    VerifyStarted,
    WriterDead,
    WriterReadmitted,
)
from pdflow.core.rooms.receiver_room import ReceiverRoom, ReceiverState
from pdflow.core.rooms.sender_room import SenderRoom, SenderState
from pdflow.sim.invariants import Transition

ROOM = 42
GEN = 7
PREFILL = PeerId("10.0.0.1:7000", "p-inc", 0)
PREFILL_B = PeerId("10.0.0.1:7001", "p-inc", 1)
DECODE = PeerId("10.0.0.2:8000", "d-inc", 0)
SESSION = DECODE.address
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


AUX = b"first-token-row!"
"""The sample room's aux row (the prefill engine's; the decode's slot 3 gets it)."""


def completed(
    seq: int, ok: bool = True, reason: str = "", checksum: int | None = None,
    aux: bytes | None = None,
) -> TransferCompleted:
    """The transport's answer to the sample room's write ``seq`` (and, for a last chunk, the
    aux row the shell read)."""
    return TransferCompleted(ROOM, GEN, seq, ok, reason, checksum, aux)


def new_sender(policy: AllocationPolicy = AllocationPolicy.EARLY, now: float = 0.0) -> SenderRoom:
    return SenderRoom(ROOM, GEN, PREFILL, now, policy=policy, timeouts=TIMEOUTS)


def sender_in(state: SenderState) -> SenderRoom:
    room = new_sender()
    recipes: dict[SenderState, list[Input]] = {
        SenderState.BOOTSTRAPPING: [MetadataArrived(metadata(required=2))],
        SenderState.WAITING_FOR_INPUT: [MetadataArrived(metadata())],
        SenderState.TRANSFERRING: [
            MetadataArrived(metadata()), InitTransfer(4, aux_index=0), SendChunk((1, 2), False),
            SendChunk((3,), False),
        ],
        SenderState.SUCCESS: [
            MetadataArrived(metadata()), InitTransfer(1, aux_index=0), SendChunk((1,), True),
            completed(0),
        ],
        SenderState.DRAINING: [
            MetadataArrived(metadata()), InitTransfer(4, aux_index=0), SendChunk((1, 2), False),
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
    init: list[Input] = [InitTransfer(4, aux_index=0)] if needs_init else []
    pages = room.num_pages if room.num_pages is not None else 4
    chunk = SendChunk((9,), room.next_page + 1 == pages)
    return {
        "MetadataArrived": [MetadataArrived(metadata(DECODE_B, required=2))]
        if room.state is SenderState.BOOTSTRAPPING
        else [MetadataArrived(metadata())],
        "InitTransfer": [InitTransfer(4, aux_index=0)],
        "SendChunk": [*init, chunk],
        "TransferCompleted": [completed(first_seq)],
        "AbortArrived": [abort()],
        "AbortRequested": [AbortRequested("test")],
        "PrefillCompleted": [PrefillCompleted()],
        "Tick": [Tick()],
    }


def new_receiver(
    policy: AllocationPolicy = AllocationPolicy.EARLY, *, verify: bool = False,
    require: bool = False, now: float = 0.0,
) -> ReceiverRoom:
    return ReceiverRoom(ROOM, GEN, DECODE, now, policy=policy, timeouts=TIMEOUTS,
                        verify_checksums=verify, require_checksums=require,
                        session_id=SESSION)


def resolved(*peers: PeerId, required: int | None = None) -> PeersResolved:
    targets = tuple(PrefillTarget(p) for p in (peers or (PREFILL,)))
    return PeersResolved(targets, required if required is not None else len(targets))


PUBLISH = PublishPages(ROOM, (100, 101, 102), 3)


def receiver_in(state: ReceiverState) -> ReceiverRoom:
    pc = AllocationPolicy.PREFILL_COMPLETE
    policy = pc if state is ReceiverState.AWAITING_READY else AllocationPolicy.EARLY
    room = new_receiver(policy, verify=state is ReceiverState.VERIFYING)
    recipes: dict[ReceiverState, list[Input]] = {
        ReceiverState.BOOTSTRAPPING: [],
        ReceiverState.AWAITING_READY: [resolved()],
        ReceiverState.AWAITING_PAGES: [resolved()],
        ReceiverState.TRANSFERRING: [resolved(PREFILL, PREFILL_B), PUBLISH],
        ReceiverState.VERIFYING: [resolved(), PUBLISH, SuccessArrived(PREFILL, 5, AUX)],
        ReceiverState.SUCCESS: [resolved(), PUBLISH, SuccessArrived(PREFILL, aux=AUX)],
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
        "PublishPages": [PUBLISH],
        "SuccessArrived": [SuccessArrived(PREFILL, aux=AUX)],
        "FailureArrived": [FailureArrived(PREFILL, "boom")],
        "PeerDied": [PeerDied(PREFILL)],
        "AbortRequested": [AbortRequested("test")],
        "ChecksumResult": [ChecksumResult(True)],
        "StagingWait": [StagingWait()],
        "Tick": [Tick()],
    }


def _record(reached: Counter[Transition], fired: Fired | tuple[Fired, ...]) -> None:
    for f in fired if isinstance(fired, tuple) else (fired,):
        reached[(f.machine, f.source, f.on, f.guard, f.target)] += 1


def room_cell_coverage() -> Counter[Transition]:
    """Each room state offered each input (refused cells are skipped: they are no transition)."""
    reached: Counter[Transition] = Counter()
    drives: list[tuple[Callable[[Any], Any], Callable[[Any], dict[str, list[Input]]], Any]] = [
        (sender_in, sender_samples, SenderState),
        (receiver_in, receiver_samples, ReceiverState),
    ]
    for build, samples, states in drives:
        for state in states:
            for steps in samples(build(state)).values():
                room = build(state)
                try:
                    for inp in steps:
                        _record(reached, room.fire(inp, 2.0)[1])
                except ProtocolError:
                    continue
    # An engine abort between chunks, with every write so far completed.
    sender = sender_in(SenderState.TRANSFERRING)
    for seq in sorted(sender.outstanding):
        _record(reached, sender.fire(completed(seq), 2.0)[1])
    _record(reached, sender.fire(AbortRequested("engine gave up"), 2.0)[1])
    # ...and a decode's ABORT there.
    sender = sender_in(SenderState.TRANSFERRING)
    for seq in sorted(sender.outstanding):
        _record(reached, sender.fire(completed(seq), 2.0)[1])
    _record(reached, sender.fire(abort(), 2.0)[1])
    # A verification that fails (worlds draw corrupt writes only for some seeds).
    verifying = receiver_in(ReceiverState.VERIFYING)
    _record(reached, verifying.fire(ChecksumResult(False, "checksum mismatch"), 2.0)[1])
    # A decode that requires checksums, and a writer that sent none.
    receiver = new_receiver(require=True)
    for inp in (resolved(), PUBLISH, SuccessArrived(PREFILL)):
        _record(reached, receiver.fire(inp, 2.0)[1])
    # The wait for pages expiring (prefill_complete: the ready signal restarts the wait clock);
    # the worlds reach it only in some seeds, as the engine usually publishes in time.
    receiver = new_receiver(AllocationPolicy.PREFILL_COMPLETE)
    for inp in (resolved(), ReadyArrived(PREFILL), Tick()):
        _record(reached, receiver.fire(inp, 1.0 if not isinstance(inp, Tick) else 10_000.0)[1])
    # A writer that sent no aux row into a room that published an aux slot.
    receiver = new_receiver()
    for inp in (resolved(), PUBLISH, SuccessArrived(PREFILL)):
        _record(reached, receiver.fire(inp, 2.0)[1])
    return reached


def ledger_cell_coverage() -> Counter[Transition]:
    """Ledger rows the worlds reach rarely or never: an unpublished release, a death reported
    after the session closed, an ACK for pages that are reserved but not fenced."""
    reached: Counter[Transition] = Counter()
    writer = PeerId("10.0.0.1:7000", "inc", 0)
    alive = PeerId("10.0.0.1:7000", "inc", 1)
    other = PeerId("10.0.0.1:7001", "inc", 1)
    ledger = PageLedger(4)
    steps: list[LedgerInput] = [
        Reserve(1, 1, (0,)), ReleaseUnpublished(1, 1), Reserve(2, 1, (1,)),
        Fence(2, 1, (writer,)), SessionClosed(writer), WriterDead(writer),
        Reserve(3, 1, (2,)), AckArrived(3, 1, writer),
        VerifyStarted(3, 1), ReleaseAfterSuccess(3, 1), VerifyDone(3, 1),
        # Fence by engine rotation: room 4 was published under the retired session, room 5
        # under the new one (its writer, alive, stays owed).
        Reserve(4, 1, (2,)), Fence(4, 1, (alive,), "decode:old"),
        Reserve(5, 1, (3,)), Fence(5, 1, (alive,), "decode:new"), SessionRetired("decode:old"),
        # A room fenced when its only writer is already dead and fenced: freed at once.
        Reserve(6, 1, (0,)), Fence(6, 1, (writer,)),
        # A writer wrongly declared dead, readmitted while a room it was fenced in still waits.
        Reserve(7, 1, (1,)), Fence(7, 1, (writer, other)), AckArrived(2, 1, writer),
        WriterReadmitted(writer),
    ]  # fmt: skip
    for inp in steps:
        _record(reached, ledger.handle(inp, 1.0).fired)
    return reached


def slot_cell_coverage() -> Counter[Transition]:
    """Room-slot rows no world reaches: the bounds (more room ids pending, or more decode peers
    parked, than a world has), a parked slot ticked before it is due, and, for completeness,
    every prefill slot story driven through a real endpoint."""
    reached: Counter[Transition] = Counter()
    config = PrefillEndpointConfig(
        me=PREFILL, timeouts=TIMEOUTS, max_pending_room_ids=1, max_parked_peers=2
    )
    endpoint = PrefillEndpoint(config)

    def feed(inp: AnyEndpointInput, now: float = 1.0) -> None:
        _record(reached, endpoint.handle(inp, now).fired)

    def meta(room: int, generation: int, decode: PeerId = DECODE) -> Received:
        return Received(msgspec.structs.replace(metadata(decode), room=room, generation=generation))

    def stray_abort(room: int, generation: int) -> Received:
        return Received(Abort(room=room, generation=generation, decode=DECODE, prefill=PREFILL))

    feed(meta(1, 1))  # ABSENT -> PARKED
    for rank in range(config.max_parked_peers + 1):  # PARKED: one decode peer too many
        feed(meta(1, 1, PeerId("10.0.0.3:8000", "d-many", rank)))
    feed(meta(2, 1))  # another room id while one is pending: over the cap
    feed(stray_abort(2, 1))
    feed(stray_abort(1, 1))  # PARKED -> CANCELLED
    feed(stray_abort(1, 1))
    feed(meta(1, 1))
    feed(OpenRoom(1, 1))  # CANCELLED -> OPEN, failed at once
    feed(ClearRoom(1))
    feed(meta(1, 1))  # REMOVED
    feed(stray_abort(1, 1))  # the opened mark's own generation: kept nowhere
    # ABORTs below the mark (generation 1 may still open late): a cancel kept, then the cap.
    for room in (5, 6):
        feed(OpenRoom(room, 2))
        feed(RoomCall(room, AbortRequested("engine gave up")))
        feed(ClearRoom(room))
        feed(stray_abort(room, 1))
    # A room cleared with two writes in flight drains; late metadata and ABORT reach it there.
    endpoint = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, timeouts=TIMEOUTS))
    feed(OpenRoom(3, 1))
    feed(meta(3, 1))
    feed(RoomCall(3, InitTransfer(2, aux_index=0)))
    feed(RoomCall(3, SendChunk((1,), False)))
    feed(RoomCall(3, SendChunk((2,), True)))
    feed(RoomCall(3, AbortRequested("engine gave up")))
    feed(ClearRoom(3))
    feed(meta(3, 1))
    feed(stray_abort(3, 1))
    feed(TransferCompleted(3, 1, 0, True, checksum=0))
    feed(TransferCompleted(3, 1, 1, True, checksum=0))
    # Metadata for a generation older than the one already parked.
    feed(meta(4, 3))
    feed(meta(4, 2))
    return reached


def cell_coverage() -> Counter[Transition]:
    return room_cell_coverage() + ledger_cell_coverage() + slot_cell_coverage()
