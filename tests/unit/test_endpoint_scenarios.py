"""Endpoint scenarios, one per bug class seen in peers' PD transfer code.

Each test drives real endpoints (and, where bytes matter, the simulator's fake transport)
through the story of one reported bug and checks that pdflow's protocol rules it out.
"""

from __future__ import annotations

import msgspec
import pytest

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    CloseSession,
    DecodeEndpointConfig,
    Dropped,
    HeartbeatResult,
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
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError
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
from pdflow.core.resources.page_ledger import PagesFreed, PagesQuarantined, SessionClosed

BOOT = "10.0.9.1:8998"
TIMEOUTS = Timeouts(bootstrap_timeout=30.0, waiting_timeout=30.0)
PREFILL_A = PeerId("10.0.0.1:7000", "inc-a", 0)
PREFILL_B = PeerId("10.0.0.1:7000", "inc-b", 0)
DECODE = PeerId("10.0.1.1:8000", "dec-1", 0)


def info(prefill: PeerId, policy: AllocationPolicy = AllocationPolicy.EARLY) -> PrefillInfo:
    return PrefillInfo(
        bootstrap=BOOT,
        tp_size=1,
        cp_size=1,
        pp_size=1,
        dp_size=1,
        page_size=16,
        kv_cache_dtype="auto",
        policy=policy,
        ranks=(RegisteredPrefillRank(dp=0, cp=0, tp=0, pp=0, peer=prefill),),
    )


def prefill(
    me: PeerId = PREFILL_A, policy: AllocationPolicy = AllocationPolicy.EARLY
) -> PrefillEndpoint:
    return PrefillEndpoint(PrefillEndpointConfig(me=me, policy=policy, timeouts=TIMEOUTS))


def decode(policy: AllocationPolicy = AllocationPolicy.EARLY) -> DecodeEndpoint:
    return DecodeEndpoint(
        DecodeEndpointConfig(me=DECODE, num_pages=8, policy=policy, timeouts=TIMEOUTS)
    )


def sent(step: Step, kind: type) -> list:
    return [
        o.message
        for o in step.outputs
        if isinstance(o, SendMessage) and isinstance(o.message, kind)
    ]


def polls(step: Step) -> list[KVPoll]:
    return [o.poll for o in step.outputs if isinstance(o, StatusChanged)]


def published_decode(
    room: int = 1, gen: int = 1, prefill_peer: PeerId = PREFILL_A, pages: tuple[int, ...] = (0, 1)
) -> tuple[DecodeEndpoint, RoomMetadata]:
    """A decode endpoint whose room has resolved its prefill and published ``pages``."""
    d = decode()
    d.handle(OpenReceiver(room, gen, BOOT), 0.0)
    d.handle(TopologyKnown(info(prefill_peer)), 0.0)
    step = d.handle(PublishPages(room, pages, aux_index=None), 0.0)
    (metadata,) = sent(step, RoomMetadata)
    return d, metadata


def transferring_prefill(
    metadata: RoomMetadata, me: PeerId = PREFILL_A
) -> tuple[PrefillEndpoint, StartTransfer]:
    """A prefill endpoint with one write of ``metadata``'s room in flight."""
    p = prefill(me)
    p.handle(OpenRoom(metadata.room, metadata.generation), 0.0)
    p.handle(Received(metadata), 0.0)
    p.handle(RoomCall(metadata.room, InitTransfer(len(metadata.dst_pages))), 0.0)
    step = p.handle(RoomCall(metadata.room, SendChunk((10, 11), is_last=True)), 0.0)
    (write,) = [o for o in step.outputs if isinstance(o, StartTransfer)]
    return p, write


@pytest.mark.invariant("drain_before_ack", "fence_before_abort")
def test_abort_mid_transfer_keeps_pages_until_the_drain_ack() -> None:
    """sglang#35049 / #32564 / #24527: a decode abort mid-transfer must not free pages a late
    write may still hit (silent cross-request KV corruption)."""
    d, metadata = published_decode()
    p, write = transferring_prefill(metadata)
    step = d.handle(RoomCall(1, AbortRequested("client went away")), 1.0)
    assert [o for o in step.outputs if isinstance(o, PagesQuarantined)]
    (abort,) = sent(step, Abort)
    d.handle(ClearRoom(1), 1.0)
    assert not d.ledger.is_free(0) and not d.ledger.is_free(1)
    # The abort reaches the prefill while its write is still landing: no ACK yet.
    assert not sent(p.handle(Received(abort), 1.5), AbortAck)
    assert not d.ledger.is_free(0)
    drained = p.handle(TransferCompleted(1, 1, write.seq, ok=True, checksum=0), 2.0)
    (ack,) = sent(drained, AbortAck)
    freed = d.handle(Received(ack), 2.5)
    assert next(o for o in freed.outputs if isinstance(o, PagesFreed)).pages == (0, 1)
    assert d.ledger.is_free(0) and d.ledger.is_free(1)


@pytest.mark.invariant("pages_return")
def test_ack_that_never_comes_keeps_pages_quarantined_and_reported() -> None:
    """sglang#38961: when the drain ACK never arrives the pages stay quarantined, reported with
    their age and the writer they wait on, and no timer ever releases them."""
    d, _ = published_decode()
    d.handle(RoomCall(1, AbortRequested("cancelled")), 1.0)
    d.handle(ClearRoom(1), 1.0)
    for now in (10.0, 100.0, 10_000.0):
        d.handle(TimerFired(), now)
        assert not d.ledger.is_free(0)
    (held,) = d.ledger.report(10_000.0)
    assert held.pages == (0, 1) and held.waiting_on == (PREFILL_A,)
    assert held.age_s == pytest.approx(9_999.0)


@pytest.mark.invariant("pages_return")
def test_abort_of_a_transfer_leaks_nothing_on_either_side() -> None:
    """sglang#9266 / #8177: after an abort both sides return every page and forget the room."""
    d, metadata = published_decode()
    p, write = transferring_prefill(metadata)
    (abort,) = sent(d.handle(RoomCall(1, AbortRequested("abort")), 1.0), Abort)
    p.handle(Received(abort), 1.0)
    p.handle(ClearRoom(1), 1.0)  # still draining: removed once the write completes
    (ack,) = sent(p.handle(TransferCompleted(1, 1, write.seq, ok=False, reason="x"), 2.0), AbortAck)
    d.handle(Received(ack), 2.0)
    d.handle(ClearRoom(1), 2.0)
    assert not p.rooms and p.outstanding_writes == 0
    assert not d.rooms and d.ledger.allocatable == d.ledger.pool_size


@pytest.mark.invariant("no_resurrection")
def test_prefill_restart_serves_new_rooms_and_drops_old_incarnation_messages() -> None:
    """sglang#16903: a restarted prefill (new incarnation) serves new rooms without restarting
    the decode; messages of the old incarnation are dropped and its writers are cleared."""
    d, _ = published_decode()
    step = d.handle(HeartbeatResult(BOOT, ok=True, incarnation="inc-b"), 5.0)
    assert polls(step) == [KVPoll.Failed]
    assert [o for o in step.outputs if isinstance(o, CloseSession)] == [CloseSession(PREFILL_A)]
    freed = d.handle(SessionClosed(PREFILL_A), 5.0)
    assert [o for o in freed.outputs if isinstance(o, PagesFreed)]
    late = StatusReport_success(PREFILL_A, room=2, gen=1)
    # A new room resolves against the new incarnation...
    d.handle(ClearRoom(1), 5.0)
    d.handle(OpenReceiver(2, 1, BOOT), 6.0)
    d.handle(TopologyKnown(info(PREFILL_B)), 6.0)
    step = d.handle(PublishPages(2, (2, 3), aux_index=None), 6.0)
    (metadata,) = sent(step, RoomMetadata)
    assert metadata.prefill == PREFILL_B
    # ...and a status of the old incarnation for it is refused, never counted as Success.
    step = d.handle(Received(late), 6.5)
    assert [o for o in step.outputs if isinstance(o, Dropped)]
    assert d.rooms[2].poll is KVPoll.Transferring
    # The new prefill drops metadata addressed to the old incarnation.
    p = prefill(PREFILL_B)
    p.handle(OpenRoom(2, 1), 6.0)
    stale = RoomMetadata(
        room=2,
        generation=1,
        decode=DECODE,
        prefill=PREFILL_A,
        session_id="s",
        dst_pages=(2, 3),
        aux_index=0,
        required_dst_info_num=1,
    )
    dropped = p.handle(Received(stale), 6.5)
    assert [o.kind for o in dropped.outputs if isinstance(o, Dropped)] == ["stale_incarnation"]
    assert p.rooms[2].poll is KVPoll.Bootstrapping


def StatusReport_success(prefill_peer: PeerId, *, room: int, gen: int):
    from pdflow.core.protocol.messages import StatusReport

    return StatusReport(
        room=room, generation=gen, status=KVPoll.Success, prefill=prefill_peer, decode=DECODE
    )


@pytest.mark.invariant("no_resurrection")
def test_room_reuse_late_messages_of_an_earlier_use_never_touch_the_new_one() -> None:
    """Room ids are reused with a new generation: a late ACK or status of generation 1 has no
    effect on generation 2 of the same room id."""
    d, _ = published_decode(room=1, gen=1)
    (_abort,) = sent(d.handle(RoomCall(1, AbortRequested("x")), 1.0), Abort)
    d.handle(ClearRoom(1), 1.0)
    # Generation 1's pages (0, 1) stay quarantined; generation 2 gets other pages.
    d.handle(OpenReceiver(1, 2, BOOT), 2.0)
    d.handle(PublishPages(1, (2, 3), aux_index=None), 2.0)
    late_status = d.handle(Received(StatusReport_success(PREFILL_A, room=1, gen=1)), 3.0)
    assert [o for o in late_status.outputs if isinstance(o, Dropped)]
    assert d.rooms[1].poll is KVPoll.Transferring
    ack = AbortAck(room=1, generation=1, prefill=PREFILL_A, decode=DECODE)
    freed = d.handle(Received(ack), 3.0)
    assert [o.pages for o in freed.outputs if isinstance(o, PagesFreed)] == [(0, 1)]
    assert not d.ledger.is_free(2) and not d.ledger.is_free(3)
    assert d.rooms[1].generation == 2 and d.rooms[1].poll is KVPoll.Transferring


@pytest.mark.invariant("abort_is_final")
def test_abort_for_an_unknown_room_is_acked_at_once() -> None:
    """An ABORT for a room the prefill never opened is ACKed at once: nothing can be writing."""
    p = prefill()
    abort = Abort(room=9, generation=1, decode=DECODE, prefill=PREFILL_A, reason="x")
    (ack,) = sent(p.handle(Received(abort), 0.0), AbortAck)
    assert (ack.room, ack.generation, ack.prefill) == (9, 1, PREFILL_A)
    assert not p.rooms


@pytest.mark.invariant("abort_is_final")
def test_cancel_before_the_sender_exists_is_not_lost() -> None:
    """A cancel that arrives before the engine opens the room fails the room on open."""
    p = prefill()
    p.handle(Received(Abort(room=9, generation=1, decode=DECODE, prefill=PREFILL_A)), 0.0)
    step = p.handle(OpenRoom(9, 1), 1.0)
    assert polls(step) == [KVPoll.Failed]
    assert p.rooms[9].poll is KVPoll.Failed


@pytest.mark.invariant("duplicate_claim_fails")
def test_duplicate_room_claim_fails_and_changes_nothing() -> None:
    """Opening a room id already open fails the new claim; the existing room is untouched."""
    p = prefill()
    p.handle(OpenRoom(3, 1), 0.0)
    before = p.snapshot()
    with pytest.raises(LocalProtocolError, match="duplicate claim"):
        p.handle(OpenRoom(3, 2), 1.0)
    assert p.snapshot() == before
    d = decode()
    d.handle(OpenReceiver(3, 1, BOOT), 0.0)
    before_d = d.snapshot()
    with pytest.raises(LocalProtocolError, match="duplicate claim"):
        d.handle(OpenReceiver(3, 2, BOOT), 1.0)
    assert d.snapshot() == before_d


@pytest.mark.invariant("no_status_after_clear", "no_resurrection")
def test_late_status_after_clear_has_no_effect() -> None:
    """A status that arrives after the engine cleared the room is dropped and creates nothing."""
    d, _ = published_decode()
    d.handle(RoomCall(1, AbortRequested("x")), 1.0)
    d.handle(ClearRoom(1), 1.0)
    step = d.handle(Received(StatusReport_success(PREFILL_A, room=1, gen=1)), 2.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["unknown_room"]
    assert not d.rooms and not polls(step)


@pytest.mark.invariant("generation_isolation")
def test_a_later_claim_under_prefill_complete_supersedes_an_earlier_bootstrap() -> None:
    """Under prefill_complete, a decode's bootstrap request for an earlier generation of a room
    id (one the prefill never opened) no longer holds the id: opening the next generation
    succeeds, and the endpoint waiting on the earlier one is told it failed."""
    policy = AllocationPolicy.PREFILL_COMPLETE
    p = prefill(policy=policy)
    stale = BootstrapRequest(room=4, generation=1, decode=DECODE, prefill=PREFILL_A)
    p.handle(Received(stale), 0.0)
    step = p.handle(OpenRoom(4, 2), 1.0)
    (notice,) = sent(step, StatusReport)
    assert (notice.generation, notice.status) == (1, KVPoll.Failed)
    assert p.rooms[4].generation == 2 and p.rooms[4].poll is KVPoll.Bootstrapping


@pytest.mark.invariant("lost_instance_fails_rooms")
def test_late_topology_answer_does_not_hide_the_old_writers() -> None:
    """Found by the model checker: a second, late topology answer naming a restarted prefill
    (new incarnation) overwrote the cached topology. The heartbeat then compared against the
    new incarnation, so the old writers were never declared dead: a room fenced on them kept
    its pages quarantined forever although their process was gone. A topology answer for an
    instance already cached is now dropped; the heartbeat reports the restart, which clears
    the old writers."""
    d, _ = published_decode()
    late = d.handle(TopologyKnown(info(PREFILL_B)), 1.0)
    assert [o.kind for o in late.outputs if isinstance(o, Dropped)] == ["stale_topology"]
    d.handle(RoomCall(1, AbortRequested("x")), 2.0)
    d.handle(ClearRoom(1), 2.0)
    assert not d.ledger.is_free(0)
    step = d.handle(HeartbeatResult(BOOT, ok=True, incarnation="inc-b"), 3.0)
    assert CloseSession(PREFILL_A) in step.outputs
    freed = d.handle(SessionClosed(PREFILL_A), 3.0)
    assert [o.pages for o in freed.outputs if isinstance(o, PagesFreed)] == [(0, 1)]


@pytest.mark.invariant("abort_is_final")
def test_a_cancel_before_open_outlives_every_timer_and_duplicate() -> None:
    """Found by the model checker (seed 2377): a decode aborts a room the prefill has not opened,
    the prefill ACKs (so the decode frees the pages), and a duplicate of the room's metadata
    arrives after the parked entry would have expired. The cancel must still win: the room
    opens Failed and never writes into the freed pages (sglang#35049 class, via duplication)."""
    from pdflow.core.endpoints.endpoint_io import (
        OpenRoom,
        PrefillEndpointConfig,
        Received,
        TimerFired,
    )
    from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
    from pdflow.core.framework.kvpoll import KVPoll
    from pdflow.core.protocol.messages import Abort, AbortAck, PeerId, RoomMetadata
    from pdflow.core.protocol.outputs import SendMessage
    from pdflow.core.protocol.policy import Timeouts

    me = PeerId("127.0.0.1:7000", "p1", 0)
    decode = PeerId("127.0.0.1:8000", "d1", 0)
    prefill = PrefillEndpoint(PrefillEndpointConfig(me=me, timeouts=Timeouts(10.0, 10.0)))
    metadata = RoomMetadata(room=2, generation=1, decode=decode, prefill=me, session_id="s",
                            dst_pages=(5, 6), aux_index=0, required_dst_info_num=1)  # fmt: skip
    prefill.handle(Received(metadata), 0.0)
    acked = prefill.handle(Received(Abort(2, 1, decode, me, "waiting timeout")), 1.0)
    assert [type(o.message) for o in acked.outputs if isinstance(o, SendMessage)] == [AbortAck]
    prefill.handle(TimerFired(), 1_000.0)
    late = prefill.handle(Received(metadata), 1_001.0)
    assert [o.kind for o in late.outputs if hasattr(o, "kind")] == ["aborted_room"]
    prefill.handle(OpenRoom(2, 1), 1_002.0)
    summary = prefill.summary(2)
    assert summary is not None and summary.poll is KVPoll.Failed and summary.peers == 0


def test_a_room_of_a_dp_prefill_that_does_not_follow_the_room_needs_its_dp_rank() -> None:
    """room % dp would guess a DP group; without the registered dp rank the room fails, with
    one it resolves to that group."""
    other = PeerId("10.0.0.2:7000", "inc-c", 0)
    two_groups = msgspec.structs.replace(
        info(PREFILL_A), dp_size=2, follow_bootstrap_room=False,
        ranks=(RegisteredPrefillRank(dp=0, cp=0, tp=0, pp=0, peer=PREFILL_A),
               RegisteredPrefillRank(dp=1, cp=0, tp=0, pp=0, peer=other)),
    )  # fmt: skip
    d = decode()
    d.handle(OpenReceiver(4, 1, BOOT), 0.0)
    d.handle(OpenReceiver(6, 1, BOOT, prefill_dp_rank=1), 0.0)
    d.handle(TopologyKnown(two_groups), 0.0)
    guessed = d.summary(4)
    assert guessed is not None and guessed.poll is KVPoll.Failed
    assert "follow_bootstrap_room is off" in guessed.reason
    routed = d.summary(6)
    assert routed is not None and routed.poll is KVPoll.WaitingForInput
    assert d.rooms[6].targets[0].peer == other


@pytest.mark.parametrize(
    "pages", [(2, 3), (4, 4), (7, 8), (-1,)],
    ids=["another room's", "twice", "past the pool", "negative"],
)  # fmt: skip
def test_pages_published_for_a_failed_room_are_checked_against_the_ledger(
    pages: tuple[int, ...],
) -> None:
    # A failed room's publish freed whatever pages the engine passed, unchecked: pages another
    # room holds (its writer may still land there) were reported free for reuse.
    d, _ = published_decode(room=1, pages=(2, 3))
    d.handle(OpenReceiver(2, 1, BOOT), 0.0)
    d.handle(RoomCall(2, AbortRequested("client went away")), 0.0)
    assert d.summary(2).poll is KVPoll.Failed  # type: ignore[union-attr]
    before = (d.snapshot(), d.ledger.snapshot())
    with pytest.raises(InvalidInput):
        d.handle(PublishPages(2, pages, aux_index=None), 1.0)
    assert (d.snapshot(), d.ledger.snapshot()) == before
    freed = d.handle(PublishPages(2, (4, 5), aux_index=None), 1.0)
    assert [o.pages for o in freed.outputs if isinstance(o, PagesFreed)] == [(4, 5)]


BAD_GENERATIONS = [-1, -(2**63), 2**63]


@pytest.mark.parametrize("generation", BAD_GENERATIONS)
def test_an_open_with_a_generation_outside_the_wire_range_is_refused(generation: int) -> None:
    # Negative generations opened, and the prefill's room-id records read -2**63 as "none".
    p, d = prefill(), decode()
    before = (p.snapshot(), d.snapshot())
    with pytest.raises(InvalidInput, match="outside"):
        p.handle(OpenRoom(7, generation), 0.0)
    with pytest.raises(InvalidInput, match="outside"):
        d.handle(OpenReceiver(7, generation, BOOT), 0.0)
    assert (p.snapshot(), d.snapshot()) == before
    p.handle(OpenRoom(7, 2**63 - 1), 0.0)
    d.handle(OpenReceiver(7, 0, BOOT), 0.0)
    assert p.generation_of(7) == 2**63 - 1 and d.generation_of(7) == 0


@pytest.mark.parametrize("room_id", [-1, 2**63])
def test_an_open_with_a_room_id_outside_the_wire_range_is_refused(room_id: int) -> None:
    # Both sides opened room -1 (and 2**63), whose every message no peer's codec decodes.
    p, d = prefill(), decode()
    before = (p.snapshot(), d.snapshot())
    with pytest.raises(InvalidInput, match=f"room id {room_id} is outside"):
        p.handle(OpenRoom(room_id, 1), 0.0)
    with pytest.raises(InvalidInput, match=f"room id {room_id} is outside"):
        d.handle(OpenReceiver(room_id, 1, BOOT), 0.0)
    assert (p.snapshot(), d.snapshot()) == before
    p.handle(OpenRoom(2**63 - 1, 1), 0.0)
    d.handle(OpenReceiver(0, 1, BOOT), 0.0)
    assert p.is_open(2**63 - 1) and d.is_open(0)


@pytest.mark.parametrize(
    ("published", "why"),
    [
        (PublishPages(1, (0, 1), aux_index=-1), "aux_index -1 is outside"),
        (PublishPages(1, (0, 1), aux_index=None, state_indices=((0,), (-4,))),
         "state index -4 is outside"),
    ],
    ids=["negative aux slot", "negative state index"],
)  # fmt: skip
def test_pages_published_with_an_index_outside_the_wire_range_are_refused(
    published: PublishPages, why: str
) -> None:
    # They were reserved and sent on in the room's metadata, which the prefill's codec drops.
    d = decode()
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    before = (d.snapshot(), d.ledger.snapshot())
    with pytest.raises(InvalidInput, match=why):
        d.handle(published, 1.0)
    assert (d.snapshot(), d.ledger.snapshot()) == before


@pytest.mark.parametrize("generation", BAD_GENERATIONS)
def test_a_peer_message_with_a_generation_outside_the_wire_range_is_dropped(
    generation: int,
) -> None:
    p = prefill(policy=AllocationPolicy.PREFILL_COMPLETE)
    for message in (
        Abort(7, generation, DECODE, PREFILL_A),
        BootstrapRequest(7, generation, DECODE, PREFILL_A),
        RoomMetadata(7, generation, DECODE, PREFILL_A, "s", (0,), None, 1),
    ):
        step = p.handle(Received(message), 0.0)
        assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["bad_generation"]
        assert not sent(step, AbortAck), "no ACK: no open of that generation can be refused"
    assert p.counters["dropped_bad_generation"] == 3
    assert not p.pending and p.ready_table is not None and p.ready_table.held() == 0
    d, _ = published_decode(room=7, gen=1)
    before = d.snapshot()
    for reply in (
        StatusReport(7, generation, KVPoll.Failed, PREFILL_A, DECODE),
        AbortAck(7, generation, PREFILL_A, DECODE),
    ):
        step = d.handle(Received(reply), 1.0)
        assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["bad_generation"]
    assert d.snapshot().rooms == before.rooms


def test_stray_bootstraps_hold_at_most_max_ownerless_ready_rooms_on_a_prefill() -> None:
    # BootstrapRequests for room ids no engine opens were each held for the whole TTL (600 s
    # by default) outside max_pending_room_ids: 10,000 of them, 10,000 entries.
    config = PrefillEndpointConfig(
        me=PREFILL_A, policy=AllocationPolicy.PREFILL_COMPLETE, timeouts=TIMEOUTS,
        max_ownerless_ready_rooms=100,
    )  # fmt: skip
    p = PrefillEndpoint(config)
    for room in range(10_000):
        p.handle(Received(BootstrapRequest(room, 0, DECODE, PREFILL_A)), 0.0)
    assert p.ready_table is not None and p.ready_table.held() == 100
    assert p.counters["dropped_ready_table_full"] == 9_900
    # A room the engine opens is owned, not capped: its decode is told when it is ready.
    p.handle(OpenRoom(20_000, 0), 1.0)
    p.handle(Received(BootstrapRequest(20_000, 0, DECODE, PREFILL_A)), 1.0)
    ready = p.handle(RoomCall(20_000, PrefillCompleted()), 2.0)
    assert [m.status for m in sent(ready, StatusReport)] == [KVPoll.WaitingForInput]
