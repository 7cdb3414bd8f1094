"""The nodes' room clocks measure one room instance: a cleared generation that drains after the
room id's next generation opened never removes, feeds or reports the next one's clock."""

from __future__ import annotations

import anyio

from pdflow.core.endpoints.endpoint_io import PrefillEndpointConfig, RoomRemoved
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.outputs import Output, StatusChanged
from pdflow.io.metrics import NodeMetrics
from pdflow.io.node_common import EndpointHost, EventHub, RankEffects, RoomClock

PREFILL = PeerId("127.0.0.1:7000", "p1", 0)


def host() -> EndpointHost:
    async def carry_out(output: Output, msg_id: str | None) -> None:
        """These tests hand the effects their outputs themselves."""

    endpoint = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL))
    return EndpointHost("p#0", endpoint, 0, PREFILL, lambda _: carry_out,
                        NodeMetrics("prefill", "n"), EventHub())  # fmt: skip


def finished(h: EndpointHost, outcome: str) -> float:
    return h.metrics.value("pdflow_rooms_total", {"outcome": outcome})


def test_a_draining_generation_leaves_the_next_generations_clock_alone() -> None:
    async def story() -> None:
        h = host()
        effects = RankEffects(h)
        h.clocks[9] = RoomClock(anyio.current_time(), generation=2)  # room 9's next generation
        # Generation 1 was cleared while its writes drained; now it is removed, then its
        # last status change (were one to come) names generation 1 too.
        effects.forget_room(RoomRemoved(9, 1))
        assert h.clock_of(9, 2) is not None, "the next generation's clock was dropped"
        effects.report_status(StatusChanged(9, 1, KVPoll.Failed, "drained"))
        assert finished(h, "failed") == 0.0, "generation 1 was reported with generation 2's clock"
        effects.report_status(StatusChanged(9, 2, KVPoll.Success, ""))
        assert finished(h, "success") == 1.0
        effects.forget_room(RoomRemoved(9, 2))
        assert 9 not in h.clocks

    anyio.run(story)
