"""Small-room staging through the decode endpoint (one writer, equal TP): a small room takes a
ring region only when one is free at once, and is written directly otherwise."""

from __future__ import annotations

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ChecksumChecked,
    ClearRoom,
    DecodeEndpointConfig,
    OpenReceiver,
    PrefillInfo,
    Received,
    RegisteredPrefillRank,
    RoomCall,
    StagingPlaced,
    TopologyKnown,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step
from pdflow.core.protocol.inputs import AbortRequested, PublishPages
from pdflow.core.protocol.messages import AbortAck, PeerId, RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import SendMessage, VerifyChecksums
from pdflow.core.protocol.policy import AllocationPolicy

PREFILL = PeerId("127.0.0.1:7000", "p1", 0)
DECODE = PeerId("127.0.0.1:8000", "d1", 0)
INFO = PrefillInfo(
    bootstrap="127.0.0.1:8998", tp_size=1, cp_size=1, pp_size=1, dp_size=1, page_size=16,
    kv_cache_dtype="auto", policy=AllocationPolicy.EARLY,
    ranks=(RegisteredPrefillRank(0, 0, 0, 0, PREFILL),),
)  # fmt: skip
PAGE_BYTES = 1024


def decode_endpoint(capacity_pages: int, up_to_pages: int) -> DecodeEndpoint:
    endpoint = DecodeEndpoint(
        DecodeEndpointConfig(
            me=DECODE, num_pages=64, num_kv_heads=8, staging_capacity=capacity_pages * PAGE_BYTES,
            staging_page_bytes=PAGE_BYTES, stage_rooms_up_to=up_to_pages * PAGE_BYTES,
        )
    )  # fmt: skip
    endpoint.handle(TopologyKnown(INFO), 0.0)
    return endpoint


def publish(endpoint: DecodeEndpoint, room: int, pages: tuple[int, ...], now: float) -> Step:
    endpoint.handle(OpenReceiver(room, 1, INFO.bootstrap), now)
    return endpoint.handle(PublishPages(room, pages, None), now)


def placed(step: Step) -> list[StagingPlaced]:
    return [o for o in step.outputs if isinstance(o, StagingPlaced)]


def metadata(step: Step) -> RoomMetadata:
    [found] = [
        o.message for o in step.outputs
        if isinstance(o, SendMessage) and isinstance(o.message, RoomMetadata)
    ]  # fmt: skip
    return found


def success(endpoint: DecodeEndpoint, room: int, now: float) -> Step:
    return endpoint.handle(Received(StatusReport(room, 1, KVPoll.Success, PREFILL, DECODE)), now)


def test_a_small_room_is_staged_and_finishes_after_its_scatter() -> None:
    endpoint = decode_endpoint(capacity_pages=8, up_to_pages=4)
    step = publish(endpoint, 1, (10, 11, 12), 1.0)
    [region] = placed(step)
    assert region.nbytes == 3 * PAGE_BYTES
    assert metadata(step).staging_offset == region.offset
    last = success(endpoint, 1, 2.0)
    assert any(isinstance(o, VerifyChecksums) for o in last.outputs), "the scatter is asked for"
    assert endpoint.summary(1).poll is KVPoll.Transferring  # type: ignore[union-attr]
    endpoint.handle(ChecksumChecked(1, 1, True), 2.1)
    assert endpoint.summary(1).poll is KVPoll.Success  # type: ignore[union-attr]
    assert endpoint.staging is not None and endpoint.staging.snapshot().live == ()


def test_a_room_over_the_limit_is_written_directly_and_needs_no_scatter() -> None:
    endpoint = decode_endpoint(capacity_pages=8, up_to_pages=2)
    step = publish(endpoint, 1, (10, 11, 12), 1.0)
    assert placed(step) == []
    assert metadata(step).staging_offset is None
    last = success(endpoint, 1, 2.0)
    assert not any(isinstance(o, VerifyChecksums) for o in last.outputs)
    assert endpoint.summary(1).poll is KVPoll.Success  # type: ignore[union-attr]


def test_no_limit_means_no_small_room_staging() -> None:
    endpoint = decode_endpoint(capacity_pages=8, up_to_pages=0)
    step = publish(endpoint, 1, (10,), 1.0)
    assert placed(step) == [] and metadata(step).staging_offset is None


def test_a_small_room_never_waits_for_ring_space() -> None:
    # Room 1 holds the whole ring; room 2's region would overlap it: it is written directly
    # at once (published, no StagingWait), and the region it was assigned is handed back.
    endpoint = decode_endpoint(capacity_pages=3, up_to_pages=4)
    first = publish(endpoint, 1, (10, 11, 12), 1.0)
    assert len(placed(first)) == 1
    second = publish(endpoint, 2, (20, 21), 1.0)
    assert placed(second) == []
    assert metadata(second).staging_offset is None
    assert endpoint.summary(2).poll is KVPoll.Transferring  # type: ignore[union-attr]
    assert endpoint.staging is not None
    assert [live.room for live in endpoint.staging.snapshot().live] == [1]
    success(endpoint, 2, 2.0)
    assert endpoint.summary(2).poll is KVPoll.Success  # type: ignore[union-attr]


def test_a_fenced_small_room_pins_a_region_but_later_small_rooms_still_run() -> None:
    # The hazard staging brings: a region held for a writer that may still write. A small room
    # behind it is written directly rather than waiting on the fence.
    endpoint = decode_endpoint(capacity_pages=4, up_to_pages=4)
    publish(endpoint, 1, (10, 11), 1.0)
    endpoint.handle(RoomCall(1, AbortRequested("client went away")), 1.5)
    endpoint.handle(ClearRoom(1), 1.6)
    assert endpoint.staging is not None and len(endpoint.staging.snapshot().live) == 1
    later = publish(endpoint, 2, (20, 21, 22), 2.0)
    assert placed(later) == [] and metadata(later).staging_offset is None
    success(endpoint, 2, 3.0)
    assert endpoint.summary(2).poll is KVPoll.Success  # type: ignore[union-attr]
    endpoint.handle(Received(AbortAck(1, 1, PREFILL, DECODE)), 4.0)
    assert endpoint.staging.snapshot().live == ()
    assert len(placed(publish(endpoint, 3, (30,), 5.0))) == 1, "the ring is free again"
