"""Issue 12: the guarantees hold whatever the shell reports (endpoint level, virtual clock).

Each ``test_findingN_...`` reproduces one finding of issue 12 and fails on the core before it
was fixed.
"""

from __future__ import annotations

import msgspec

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ChecksumChecked,
    ClearRoom,
    CloseSession,
    DecodeEndpointConfig,
    HeartbeatResult,
    IncarnationSuperseded,
    OpenReceiver,
    PublishPages,
    ReadmitWriter,
    Received,
    RoomCall,
    TopologyKnown,
)
from pdflow.core.endpoints.liveness import ProbeTarget
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import AbortRequested
from pdflow.core.protocol.messages import Abort, AbortAck, RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import VerifyChecksums
from pdflow.core.resources.page_ledger import SessionClosed
from tests.unit.test_endpoint_scenarios import (
    BOOT,
    DECODE,
    PREFILL_A,
    PREFILL_B,
    TIMEOUTS,
    info,
    sent,
)


def checking_decode() -> DecodeEndpoint:
    """A decode rank whose checksum setting is on (PDFLOW_CHECKSUM=1)."""
    config = DecodeEndpointConfig(me=DECODE, num_pages=8, timeouts=TIMEOUTS, verify_checksums=True)
    return DecodeEndpoint(config)


def success(checksum: int | None) -> Received:
    return Received(StatusReport(1, 1, KVPoll.Success, PREFILL_A, DECODE, checksum=checksum))


def test_finding3_writer_without_checksum_fails_the_room_closed() -> None:
    """Finding 3: decode checksum on, prefill off: the room used to end Success unverified
    (the writer without a checksum was left out of the verification)."""
    d = checking_decode()
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)  # a prefill that did not declare checksums
    (metadata,) = sent(d.handle(PublishPages(1, (0, 1), aux_index=None), 0.0), RoomMetadata)
    step = d.handle(success(None), 1.0)
    for verify in (o for o in step.outputs if isinstance(o, VerifyChecksums)):
        # What the shell answers when it is asked to check nothing: every digest matched.
        d.handle(ChecksumChecked(verify.room, verify.generation, True), 1.1)
    summary = d.summary(1)
    assert summary is not None and summary.poll is KVPoll.Failed
    assert summary.reason.startswith("KV checksum missing")
    assert f"{PREFILL_A.address}#{PREFILL_A.rank}" in summary.reason
    assert metadata.dst_pages == (0, 1)


def test_a_writer_with_its_checksum_is_still_verified() -> None:
    d = checking_decode()
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    d.handle(PublishPages(1, (0, 1), aux_index=None), 0.0)
    (verify,) = [o for o in d.handle(success(77), 1.0).outputs if isinstance(o, VerifyChecksums)]
    assert verify.expected == ((PREFILL_A, 77),)
    d.handle(ChecksumChecked(1, 1, True), 1.1)
    summary = d.summary(1)
    assert summary is not None and summary.poll is KVPoll.Success


def test_a_prefill_registered_without_checksums_is_refused_at_topology_time() -> None:
    d = checking_decode()
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    without = msgspec.structs.replace(info(PREFILL_A), checksum=False)
    d.handle(TopologyKnown(without), 0.0)
    summary = d.summary(1)
    assert summary is not None and summary.poll is KVPoll.Failed
    assert summary.reason.startswith("checksum mismatch: this decode requires KV checksums")
    assert "PDFLOW_CHECKSUM=1" in summary.reason and BOOT in summary.reason
    assert BOOT not in d.topologies, "the refused topology is not cached"
    # A prefill that does send them is taken.
    d.handle(OpenReceiver(2, 1, BOOT), 1.0)
    d.handle(TopologyKnown(msgspec.structs.replace(info(PREFILL_A), checksum=True)), 1.0)
    again = d.summary(2)
    assert again is not None and again.poll is KVPoll.WaitingForInput


# ---- finding 2: a false heartbeat failure is not permanent ----------------------------------
def _published(d: DecodeEndpoint, room: int, pages: tuple[int, ...], at: float) -> None:
    d.handle(OpenReceiver(room, 1, BOOT), at)
    if BOOT not in d.topologies:
        d.handle(TopologyKnown(info(PREFILL_A)), at)
    d.handle(PublishPages(room, pages, aux_index=0), at)
    summary = d.summary(room)
    assert summary is not None and summary.poll is KVPoll.Transferring, summary


def _declared_dead(d: DecodeEndpoint, at: float, health: str | None = None) -> Step:
    steps = [d.handle(HeartbeatResult(BOOT, False, None, health), at + i)
             for i in range(d.config.heartbeat_max_failure)]
    assert any(isinstance(o, CloseSession) for o in steps[-1].outputs)
    return steps[-1]


def test_finding2_a_live_writer_wrongly_declared_dead_is_readmitted_and_fenced_again() -> None:
    """Finding 2: one stall of the registry declared the live prefill dead for good: each
    later aborted room of that incarnation freed its pages at once, before its drain ACK,
    while its writes were still in flight. Now the verdict is lifted once the incarnation
    answers again and has drained what it owed; its later rooms are fenced as any other's."""
    d = DecodeEndpoint(DecodeEndpointConfig(me=DECODE, num_pages=8, timeouts=TIMEOUTS))
    _published(d, 1, (0, 1), 0.0)
    step = _declared_dead(d, 1.0)  # the registry stalled; the prefill is alive
    assert d.summary(1).poll is KVPoll.Failed  # type: ignore[union-attr]
    (abort,) = sent(step, Abort)
    d.handle(SessionClosed(PREFILL_A), 3.0)  # the shell fenced it on the receiving side
    assert d.ledger.is_free(0) and d.ledger.is_free(1), "dead and fenced: its pages are free"
    # It answers again (the registry it hosts reports its incarnation), then drains room 1.
    answered = d.handle(HeartbeatResult(BOOT, True, PREFILL_A.incarnation), 5.0)
    assert not any(isinstance(o, ReadmitWriter) for o in answered.outputs), "it owes an ACK"
    readmitted = d.handle(Received(AbortAck(abort.room, abort.generation, PREFILL_A, DECODE)), 5.5)
    # Its next room is served, and aborting it quarantines the pages until its drain ACK.
    d.handle(ClearRoom(1), 6.0)
    _published(d, 2, (2, 3), 6.0)
    d.handle(RoomCall(2, AbortRequested("client went away")), 7.0)
    assert not d.ledger.is_free(2) and not d.ledger.is_free(3), "freed before the drain ACK"
    d.handle(Received(AbortAck(2, 1, PREFILL_A, DECODE)), 8.0)
    assert d.ledger.is_free(2) and d.ledger.is_free(3)
    assert ReadmitWriter(PREFILL_A) in readmitted.outputs, "the shell lifts its fence"
    assert d.snapshot().counters["prefill_instances_readmitted"] == 1


def test_a_lost_writer_is_not_readmitted_before_it_drained() -> None:
    d = DecodeEndpoint(DecodeEndpointConfig(me=DECODE, num_pages=8, timeouts=TIMEOUTS))
    _published(d, 1, (0, 1), 0.0)
    _declared_dead(d, 1.0)
    for at in (5.0, 10.0):
        step = d.handle(HeartbeatResult(BOOT, True, PREFILL_A.incarnation), at)
        assert not any(isinstance(o, ReadmitWriter) for o in step.outputs)
    # Meanwhile a new room fails with a reason, never resolved to a fenced writer.
    d.handle(OpenReceiver(2, 1, BOOT), 11.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 11.0)
    summary = d.summary(2)
    assert summary is not None and summary.poll is KVPoll.Failed
    assert "not readmitted yet" in summary.reason and BOOT not in d.topologies
    assert ProbeTarget(BOOT) in d.probe_targets(), "a lost instance is still probed"
    # Once it drained, it is readmitted and the next room is served.
    step = d.handle(Received(AbortAck(1, 1, PREFILL_A, DECODE)), 12.0)
    assert ReadmitWriter(PREFILL_A) in step.outputs
    d.handle(OpenReceiver(3, 1, BOOT), 12.5)
    d.handle(TopologyKnown(info(PREFILL_A)), 12.5)
    again = d.summary(3)
    assert again is not None and again.poll is KVPoll.WaitingForInput


def test_a_superseded_incarnation_is_never_readmitted() -> None:
    health = "10.0.0.1:9000"
    own = msgspec.structs.replace(info(PREFILL_A).ranks[0], health=health)
    d = DecodeEndpoint(DecodeEndpointConfig(me=DECODE, num_pages=8, timeouts=TIMEOUTS))
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(msgspec.structs.replace(info(PREFILL_A), ranks=(own,))), 0.0)
    assert d.probe_targets() == (ProbeTarget(BOOT, health),)
    _declared_dead(d, 1.0, health)
    # A new process answers at that address: the old incarnation is replaced for good.
    step = d.handle(HeartbeatResult(BOOT, True, PREFILL_B.incarnation, health), 5.0)
    assert IncarnationSuperseded(BOOT, PREFILL_A.incarnation) in step.outputs
    assert d.snapshot().superseded == (PREFILL_A.incarnation,)
    assert d.probe_targets() == ()
    d.handle(Received(AbortAck(1, 1, PREFILL_A, DECODE)), 6.0)
    late = d.handle(HeartbeatResult(BOOT, True, PREFILL_A.incarnation, health), 7.0)
    assert not any(isinstance(o, ReadmitWriter) for o in late.outputs)
    d.handle(OpenReceiver(2, 1, BOOT), 8.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 8.0)  # a stale registry still names it
    summary = d.summary(2)
    assert summary is not None and summary.poll is KVPoll.Failed
    assert "which another incarnation replaced" in summary.reason
