"""A prefill instance declared dead and never replaced is not kept (nor probed) for ever: once
no room refers to it, it is forgotten ``lost_instance_forget_s`` after the verdict."""

from __future__ import annotations

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    DecodeEndpointConfig,
    HeartbeatResult,
    IncarnationSuperseded,
    OpenReceiver,
    PrefillInfo,
    RegisteredPrefillRank,
    TopologyKnown,
)
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.policy import AllocationPolicy

BOOT = "10.0.0.1:8998"
PREFILL = PeerId("10.0.0.1:7000", "inc-a", 0)
FORGET_S = 60.0


def lost_decode() -> DecodeEndpoint:
    """A decode whose room 1 was on PREFILL, declared dead at t=2 (two failed probes)."""
    d = DecodeEndpoint(DecodeEndpointConfig(me=PeerId("10.0.1.1:8000", "dec", 0), num_pages=8,
                                            lost_instance_forget_s=FORGET_S))  # fmt: skip
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    rank = RegisteredPrefillRank(dp=0, cp=0, tp=0, pp=0, peer=PREFILL)
    d.handle(TopologyKnown(PrefillInfo(BOOT, 1, 1, 1, 1, 16, "auto", AllocationPolicy.EARLY,
                                       (rank,))), 0.0)  # fmt: skip
    d.handle(HeartbeatResult(BOOT, ok=False), 1.0)
    d.handle(HeartbeatResult(BOOT, ok=False), 2.0)
    assert d.lost, "two failed probes declare it dead"
    return d


def test_a_lost_instance_no_room_refers_to_is_forgotten_after_the_forget_time() -> None:
    d = lost_decode()
    d.handle(ClearRoom(1), 3.0)
    d.handle(HeartbeatResult(BOOT, ok=False), 2.0 + FORGET_S - 1)
    assert d.probe_targets(), "probed until the forget time"
    step = d.handle(HeartbeatResult(BOOT, ok=False), 2.0 + FORGET_S)
    assert not d.lost and d.probe_targets() == ()
    assert [o for o in step.outputs if isinstance(o, IncarnationSuperseded)] == [
        IncarnationSuperseded(BOOT, "inc-a")
    ], "never readmitted: a registry still naming it fails the room at once"
    assert d.snapshot().counters["prefill_instances_forgotten"] == 1


def test_a_lost_instance_a_room_still_refers_to_is_kept() -> None:
    d = lost_decode()  # room 1 failed but the engine has not cleared it
    d.handle(HeartbeatResult(BOOT, ok=False), 2.0 + 10 * FORGET_S)
    assert d.lost and d.probe_targets()
