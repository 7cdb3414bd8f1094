"""Issue 12: the guarantees hold whatever the shell reports (endpoint level, virtual clock).

Each ``test_findingN_...`` reproduces one finding of issue 12 and fails on the core before it
was fixed.
"""

from __future__ import annotations

import msgspec

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ChecksumChecked,
    DecodeEndpointConfig,
    OpenReceiver,
    PublishPages,
    Received,
    TopologyKnown,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import VerifyChecksums
from tests.unit.test_endpoint_scenarios import BOOT, DECODE, PREFILL_A, TIMEOUTS, info, sent


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
