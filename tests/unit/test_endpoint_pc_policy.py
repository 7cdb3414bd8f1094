"""The prefill_complete policy end to end through both endpoints (no I/O, virtual time)."""

from __future__ import annotations

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    DecodeEndpointConfig,
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
from pdflow.core.protocol.messages import BootstrapRequest, PeerId, StatusReport
from pdflow.core.protocol.outputs import SendMessage, StartTransfer
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts

PC = AllocationPolicy.PREFILL_COMPLETE
PREFILL = PeerId("127.0.0.1:7000", "p1", 0)
DECODE = PeerId("127.0.0.1:8000", "d1", 0)
INFO = PrefillInfo(
    bootstrap="127.0.0.1:8998", tp_size=1, cp_size=1, pp_size=1, dp_size=1, page_size=16,
    kv_cache_dtype="auto", policy=PC, ranks=(RegisteredPrefillRank(0, 0, 0, 0, PREFILL),),
)  # fmt: skip
TIMEOUTS = Timeouts(bootstrap_timeout=30.0, waiting_timeout=20.0)


def pair() -> tuple[PrefillEndpoint, DecodeEndpoint]:
    prefill = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL, policy=PC, timeouts=TIMEOUTS))
    decode = DecodeEndpoint(
        DecodeEndpointConfig(me=DECODE, num_pages=32, policy=PC, timeouts=TIMEOUTS)
    )
    return prefill, decode


def messages(step: Step) -> list[object]:
    return [o.message for o in step.outputs if isinstance(o, SendMessage)]


def deliver(step: Step, to: PrefillEndpoint | DecodeEndpoint, now: float) -> list[Step]:
    return [to.handle(Received(m), now) for m in messages(step)]  # type: ignore[arg-type]


def test_ready_signal_then_pages_then_success() -> None:
    prefill, decode = pair()
    decode.handle(OpenReceiver(9, 1, INFO.bootstrap), 0.0)
    step = decode.handle(TopologyKnown(INFO), 0.0)
    assert [type(m) for m in messages(step)] == [BootstrapRequest]
    prefill.handle(OpenRoom(9, 1), 0.0)
    deliver(step, prefill, 0.1)
    assert decode.summary(9).poll is KVPoll.Bootstrapping  # type: ignore[union-attr]
    ready = prefill.handle(RoomCall(9, PrefillCompleted()), 5.0)
    [notice] = messages(ready)
    assert isinstance(notice, StatusReport) and notice.status is KVPoll.WaitingForInput
    deliver(ready, decode, 5.1)
    assert decode.summary(9).poll is KVPoll.WaitingForInput  # type: ignore[union-attr]
    published = decode.handle(PublishPages(9, (1, 2), 0), 6.0)
    deliver(published, prefill, 6.1)
    prefill.handle(RoomCall(9, InitTransfer(2, aux_index=0)), 6.2)
    chunk = prefill.handle(RoomCall(9, SendChunk((4, 5), True)), 6.2)
    write = next(o for o in chunk.outputs if isinstance(o, StartTransfer))
    done = prefill.handle(TransferCompleted(9, 1, write.seq, True, aux=b"row"), 6.3)
    deliver(done, decode, 6.4)
    assert decode.summary(9).poll is KVPoll.Success  # type: ignore[union-attr]
    assert prefill.summary(9).poll is KVPoll.Success  # type: ignore[union-attr]
    decode.handle(ClearRoom(9), 7.0)
    prefill.handle(ClearRoom(9), 7.0)
    assert decode.ledger.snapshot().free == 32


def test_ready_is_sent_once_and_a_failure_beats_a_late_ready() -> None:
    prefill, decode = pair()
    step = decode.handle(OpenReceiver(9, 1, INFO.bootstrap), 0.0)
    step = decode.handle(TopologyKnown(INFO), 0.0)
    prefill.handle(OpenRoom(9, 1), 0.0)
    deliver(step, prefill, 0.0)
    failed = prefill.handle(RoomCall(9, AbortRequested("engine gave up")), 1.0)
    [notice] = messages(failed)
    assert isinstance(notice, StatusReport) and notice.status is KVPoll.Failed
    late = prefill.handle(RoomCall(9, PrefillCompleted()), 2.0)
    assert messages(late) == [], "no ready notice after a failure"
    deliver(failed, decode, 1.1)
    assert decode.summary(9).poll is KVPoll.Failed  # type: ignore[union-attr]


def test_bootstrap_clock_counts_from_prefill_completion() -> None:
    prefill, _ = pair()
    prefill.handle(OpenRoom(9, 1), 0.0)
    prefill.handle(TimerFired(), 1_000.0)
    assert prefill.summary(9).poll is KVPoll.Bootstrapping  # type: ignore[union-attr]
    prefill.handle(RoomCall(9, PrefillCompleted()), 1_000.0)
    assert prefill.timer_at() == 1_030.0
    prefill.handle(TimerFired(), 1_030.0)
    assert prefill.summary(9).poll is KVPoll.Failed  # type: ignore[union-attr]
