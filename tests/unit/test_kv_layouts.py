"""The KV layout exchange in the core: traced table cells on both sides, bounded state."""

from __future__ import annotations

import msgspec
import pytest

from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import KvDtype, packed_layout
from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    CloseSession,
    DecodeEndpointConfig,
    Dropped,
    HeartbeatResult,
    OpenReceiver,
    PrefillEndpointConfig,
    Received,
    RoomCall,
    SessionRotated,
    TopologyKnown,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError, RemoteProtocolError
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import AbortRequested, PublishPages
from pdflow.core.protocol.messages import KvArgs, KvArgsAccepted, PeerId, RoomMetadata
from pdflow.core.protocol.outputs import SendMessage
from pdflow.core.resources.kv_layouts import (
    AcceptArrived,
    Contact,
    DecodeLayout,
    LayoutAnnouncement,
    LayoutChanged,
    LayoutEvicted,
    PeerLost,
    is_earlier_life,
    layout_bytes,
)
from pdflow.core.resources.page_ledger import PagesFreed, SessionRetired
from tests.unit.test_endpoint_scenarios import BOOT, DECODE, PREFILL_A, TIMEOUTS, info

LAYOUT = KvBuffers.from_layout(
    packed_layout(base_addr=4096, num_layers=2, num_pages=8, page_size=16, num_heads=8,
                  head_dim=4, dtype=KvDtype.FP16), 8
)  # fmt: skip


def decode_endpoint() -> DecodeEndpoint:
    return DecodeEndpoint(DecodeEndpointConfig(
        me=DECODE, num_pages=8, timeouts=TIMEOUTS, session_id="10.0.1.1:9000",
        kv_layout=LAYOUT, staging_addr=1 << 20,
    ))  # fmt: skip


def sends(step: Step) -> list[type]:
    return [type(o.message) for o in step.outputs if isinstance(o, SendMessage)]


def announcement(decode: PeerId, prefill: PeerId = PREFILL_A,
                 started_at: float | None = None) -> KvArgs:  # fmt: skip
    return KvArgs(decode, prefill, "s", LAYOUT, 1, 0, 8, started_at=started_at)


def fired(step: Step) -> list[tuple[str, str, str, str]]:
    return [(f.machine, f.source, f.on, f.target) for f in step.fired if "Layout" in f.machine]


def test_the_decode_announces_its_layout_before_its_first_message_until_answered() -> None:
    d = decode_endpoint()
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    first = d.handle(PublishPages(1, (0, 1), aux_index=0), 0.1)
    assert sends(first) == [KvArgs, RoomMetadata]
    [kv] = [o.message for o in first.outputs if isinstance(o, SendMessage)][:1]
    assert kv == KvArgs(DECODE, PREFILL_A, "10.0.1.1:9000", LAYOUT, 1, 0, 8, 1 << 20)
    assert fired(first) == [("LayoutAnnouncement", "UNANNOUNCED", "Contact", "ANNOUNCED")]
    # No answer yet (it may be lost): the next message is announced again.
    d.handle(OpenReceiver(2, 1, BOOT), 0.2)
    again = d.handle(PublishPages(2, (2, 3), aux_index=0), 0.2)
    assert sends(again) == [KvArgs, RoomMetadata]
    answer = KvArgsAccepted(PREFILL_A, DECODE, "10.0.0.1:7100")
    accepted = d.handle(Received(answer), 0.3)
    assert fired(accepted) == [("LayoutAnnouncement", "ANNOUNCED", "AcceptArrived", "ACCEPTED")]
    d.handle(OpenReceiver(3, 1, BOOT), 0.4)
    assert sends(d.handle(PublishPages(3, (4,), aux_index=0), 0.4)) == [RoomMetadata]
    # The writer dies: its fence names the session it answered with, and it is forgotten.
    lost = d.handle(HeartbeatResult(BOOT, ok=True, incarnation="a-new-life"), 5.0)
    assert CloseSession(PREFILL_A, "10.0.0.1:7100") in lost.outputs
    assert ("LayoutAnnouncement", "ACCEPTED", "PeerLost", "UNANNOUNCED") in fired(lost)
    assert d.snapshot().announced_to == 0


def test_a_decode_without_a_layout_announces_nothing() -> None:
    d = DecodeEndpoint(DecodeEndpointConfig(me=DECODE, num_pages=8, timeouts=TIMEOUTS))
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    assert sends(d.handle(PublishPages(1, (0,), aux_index=0), 0.1)) == [RoomMetadata]


def test_an_answer_from_a_prefill_never_announced_to_is_dropped_and_changes_nothing() -> None:
    d = decode_endpoint()
    before = d.snapshot()
    stranger = PeerId("127.0.0.1:1", "forged", 0)
    step = d.handle(Received(KvArgsAccepted(stranger, DECODE, "127.0.0.1:2")), 1.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["unannounced_prefill"]
    other_life = PeerId(DECODE.address, "an-earlier-life", DECODE.rank)
    step = d.handle(Received(KvArgsAccepted(PREFILL_A, other_life, "x")), 1.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["stale_incarnation"]
    assert d.snapshot().announced_to == 0
    assert d.snapshot().counters == {**before.counters, "dropped_unannounced_prefill": 1,
                                     "dropped_stale_incarnation": 1}  # fmt: skip


def prefill_endpoint(limit: int = 1024, max_layout_bytes: int = 64 << 10) -> PrefillEndpoint:
    return PrefillEndpoint(PrefillEndpointConfig(
        me=PREFILL_A, timeouts=TIMEOUTS, session_id="10.0.0.1:7100", max_decode_layouts=limit,
        max_layout_bytes=max_layout_bytes,
    ))  # fmt: skip


def test_the_prefill_keeps_one_layout_per_decode_rank_and_answers_with_its_session() -> None:
    p = prefill_endpoint()
    step = p.handle(Received(announcement(DECODE)), 0.0)
    assert step.outputs == (
        SendMessage(DECODE, KvArgsAccepted(PREFILL_A, DECODE, "10.0.0.1:7100")),
    )
    assert fired(step) == [("DecodeLayout", "ABSENT", "LayoutAnnounced", "KNOWN")]
    assert p.layout_of(DECODE) == announcement(DECODE)
    restarted = PeerId(DECODE.address, "restarted", DECODE.rank)
    step = p.handle(Received(announcement(restarted)), 1.0)
    assert fired(step) == [("DecodeLayout", "KNOWN", "LayoutAnnounced", "KNOWN")]
    assert p.layout_of(DECODE) is None and p.layout_of(restarted) == announcement(restarted)
    assert p.snapshot().decode_layouts == 1


def test_the_prefill_refuses_layouts_for_another_life_and_answers_sent_to_it() -> None:
    p = prefill_endpoint()
    earlier = PeerId(PREFILL_A.address, "an-earlier-life", PREFILL_A.rank)
    step = p.handle(Received(announcement(DECODE, earlier)), 0.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["stale_incarnation"]
    step = p.handle(Received(KvArgsAccepted(PREFILL_A, DECODE, "x")), 0.0)
    assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["wrong_direction"]
    assert p.layout_of(DECODE) is None and p.snapshot().decode_layouts == 0


def test_a_layout_over_max_layout_bytes_is_dropped_and_changes_nothing() -> None:
    """Before: any KvArgs the codec let through (up to 1 MiB) was kept, max_decode_layouts of
    them; now each is at most max_layout_bytes (encoded)."""
    fits = announcement(DECODE)
    p = prefill_endpoint(max_layout_bytes=layout_bytes(fits))
    assert sends(p.handle(Received(fits), 0.0)) == [KvArgsAccepted]  # at the limit: kept
    before = p.snapshot()
    stranger = PeerId("10.0.1.9:9000", "x", 0)
    for big in (announcement(stranger, started_at=1.0),  # a new decode rank (ABSENT)
                msgspec.structs.replace(fits, staging_addr=1 << 40)):  # the kept one, grown
        assert layout_bytes(big) > layout_bytes(fits)
        step = p.handle(Received(big), 1.0)
        assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["layout_too_large"]
        assert sends(step) == []
        assert [f.guard for f in step.fired] == ["too_large"]
    assert p.layout_of(DECODE) == fits and p.layout_of(stranger) is None
    assert p.snapshot().decode_layouts == 1
    assert p.snapshot().counters == {**before.counters, "dropped_layout_too_large": 2}


def life(incarnation: str) -> PeerId:
    """Another life of DECODE's rank: same address and rank."""
    return PeerId(DECODE.address, incarnation, DECODE.rank)


def guarded(step: Step) -> list[tuple[str, str, str | None, str]]:
    return [(f.source, f.on, f.guard, f.target) for f in step.fired if f.machine == "DecodeLayout"]


def test_an_earlier_lifes_late_layout_is_dropped_and_the_live_layout_stays() -> None:
    """Before: a late (or replayed) KvArgs of a dead life replaced the live life's layout; the
    live life's messages were then dropped (unannounced_decode) and, answered already, it never
    announced again."""
    p = prefill_endpoint(limit=2)
    live = announcement(life("live"), started_at=200.0)
    other = announcement(PeerId("10.0.1.9:9000", "x", 0), started_at=5.0)
    p.handle(Received(live), 0.0)
    p.handle(Received(other), 0.5)  # the live rank is now the least recently heard from
    before = p.snapshot()
    for late_start in (100.0, 200.0, None):  # earlier, the same instant, unknown
        step = p.handle(Received(announcement(life("dead"), started_at=late_start)), 1.0)
        assert [o.kind for o in step.outputs if isinstance(o, Dropped)] == ["stale_incarnation"]
        assert sends(step) == []  # no KvArgsAccepted to the dead life
        assert guarded(step) == [("KNOWN", "LayoutAnnounced", "older_life", "KNOWN")]
        assert p.layout_of(live.decode) == live and p.layout_of(life("dead")) is None
    assert p.snapshot().counters == {**before.counters, "dropped_stale_incarnation": 3}
    # Nothing else changed either: the dead life's KvArgs did not make the live rank the most
    # recently heard from, so a third decode evicts it rather than the other one.
    p.handle(Received(announcement(PeerId("10.0.1.8:9000", "y", 0))), 2.0)
    assert p.layout_of(live.decode) is None and p.layout_of(other.decode) == other


def test_a_later_life_replaces_the_layout_of_the_earlier() -> None:
    p = prefill_endpoint()
    p.handle(Received(announcement(life("first"), started_at=100.0)), 0.0)
    later = announcement(life("second"), started_at=100.5)
    step = p.handle(Received(later), 1.0)
    accepted = KvArgsAccepted(PREFILL_A, later.decode, "10.0.0.1:7100")
    assert step.outputs == (SendMessage(later.decode, accepted),)
    assert guarded(step) == [("KNOWN", "LayoutAnnounced", None, "KNOWN")]
    assert p.layout_of(later.decode) == later and p.layout_of(life("first")) is None


@pytest.mark.parametrize(("new", "kept", "earlier"), [
    (1.0, 2.0, True), (2.0, 2.0, True), (3.0, 2.0, False),
    (None, 2.0, True), (3.0, None, False), (None, None, False),
])  # fmt: skip
def test_lives_are_ordered_by_their_start(new: float | None, kept: float | None,
                                          earlier: bool) -> None:  # fmt: skip
    assert is_earlier_life(announcement(life("new"), started_at=new),
                           announcement(life("kept"), started_at=kept)) is earlier  # fmt: skip
    # The same life announcing again (a new transport session) is never an earlier one.
    assert not is_earlier_life(announcement(life("kept"), started_at=new),
                               announcement(life("kept"), started_at=kept))  # fmt: skip


def test_the_decode_announces_when_its_life_started() -> None:
    d = DecodeEndpoint(DecodeEndpointConfig(
        me=DECODE, num_pages=8, timeouts=TIMEOUTS, session_id="s", kv_layout=LAYOUT,
        started_at=1234.5,
    ))  # fmt: skip
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    step = d.handle(PublishPages(1, (0,), aux_index=0), 0.1)
    [kv] = [o.message for o in step.outputs
            if isinstance(o, SendMessage) and isinstance(o.message, KvArgs)]  # fmt: skip
    assert kv.started_at == 1234.5


def test_100000_forged_layouts_keep_the_prefill_at_its_bound_and_the_active_decode() -> None:
    p = prefill_endpoint(limit=64)
    p.handle(Received(announcement(DECODE)), 0.0)
    for i in range(100_000):
        forged = PeerId(f"127.0.0.1:{20000 + i % 40000}", f"forged{i}", i // 40000)
        p.handle(Received(announcement(forged)), 1.0)
        if i % 32 == 0:  # the real decode keeps talking: it is never the least recently heard
            metadata = RoomMetadata(9, 1, DECODE, PREFILL_A, "s", (0,), None, 1)
            p.handle(Received(metadata), 1.0)
    assert p.snapshot().decode_layouts == 64
    assert p.layout_of(DECODE) == announcement(DECODE)
    assert p.snapshot().counters["decode_layouts_evicted"] == 100_000 - 63


def test_cells_outside_the_tables_are_refused_and_change_nothing() -> None:
    machine = LayoutAnnouncement(PREFILL_A)
    with pytest.raises(RemoteProtocolError):
        machine.fire(AcceptArrived(KvArgsAccepted(PREFILL_A, DECODE, "s")), 0.0)
    with pytest.raises(LocalProtocolError):
        machine.fire(PeerLost(), 0.0)
    machine.fire(Contact(announcement(DECODE)), 0.0)
    machine.fire(AcceptArrived(KvArgsAccepted(PREFILL_A, DECODE, "s")), 0.0)
    with pytest.raises(LocalProtocolError):
        machine.fire(Contact(announcement(DECODE)), 0.0)
    assert machine.session_id == "s"
    layout = DecodeLayout(PREFILL_A, "s", 0, 64 << 10)
    with pytest.raises(LocalProtocolError):
        layout.fire(LayoutEvicted(), 0.0)
    assert layout.announcement is None


def test_a_rotated_session_is_announced_again_and_retired_only_once_no_live_room_uses_it() -> None:
    d = decode_endpoint()
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    d.handle(PublishPages(1, (0, 1), aux_index=0), 0.1)
    d.handle(Received(KvArgsAccepted(PREFILL_A, DECODE, "10.0.0.1:7100")), 0.2)
    d.handle(OpenReceiver(2, 1, BOOT), 0.3)  # opened, not yet published: moves with the rotation
    with pytest.raises(InvalidInput, match="new transport session"):
        d.handle(SessionRotated("10.0.1.1:9000"), 0.4)
    rotated = d.handle(SessionRotated("10.0.1.1:9001"), 0.5)
    assert fired(rotated) == [("LayoutAnnouncement", "ACCEPTED", "LayoutChanged", "STALE")]
    step = d.handle(PublishPages(2, (2,), aux_index=0), 0.6)
    messages = [o.message for o in step.outputs if isinstance(o, SendMessage)]
    assert [type(m) for m in messages] == [KvArgs, RoomMetadata]
    assert [m.session_id for m in messages if isinstance(m, (KvArgs, RoomMetadata))] == [
        "10.0.1.1:9001", "10.0.1.1:9001"]  # fmt: skip
    assert fired(step) == [("LayoutAnnouncement", "STALE", "Contact", "ANNOUNCED")]
    # Room 1 still writes through the old session: retiring it is refused, nothing changes.
    before = d.snapshot()
    with pytest.raises(InvalidInput, match=r"rooms \[1\] still depend on it"):
        d.handle(SessionRetired("10.0.1.1:9000"), 0.7)
    with pytest.raises(InvalidInput, match="current one"):
        d.handle(SessionRetired("10.0.1.1:9001"), 0.7)
    assert d.snapshot() == before
    # Room 1 fails (its writer never drains): quarantined, then freed by the retirement.
    d.handle(RoomCall(1, AbortRequested("test")), 0.8)
    assert d.quarantined_pages == 2 and d.live_rooms_on("10.0.1.1:9000") == ()
    retired = d.handle(SessionRetired("10.0.1.1:9000"), 0.9)
    assert [o for o in retired.outputs if isinstance(o, PagesFreed)] == [PagesFreed(1, 1, (0, 1))]
    assert d.quarantined_pages == 0
    assert d.snapshot().counters["sessions_rotated"] == 1
    assert d.snapshot().counters["sessions_retired"] == 1
    d.handle(ClearRoom(1), 1.0)


def test_a_stale_announcement_keeps_the_writer_session_for_its_fence() -> None:
    machine = LayoutAnnouncement(PREFILL_A)
    machine.fire(Contact(announcement(DECODE)), 0.0)
    machine.fire(LayoutChanged(), 0.1)
    machine.fire(AcceptArrived(KvArgsAccepted(PREFILL_A, DECODE, "s")), 0.2)
    assert machine.session_id == "s" and machine.state.name == "STALE"
    with pytest.raises(LocalProtocolError):
        LayoutAnnouncement(PREFILL_A).fire(LayoutChanged(), 0.0)
