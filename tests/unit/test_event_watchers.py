"""EventHub watchers: every event reaches them as it is published, in order, beside the
streams; one that raises does not stop the event reaching the others."""

from __future__ import annotations

import anyio

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import EventHub, NodeEvent, RoomClosed, RoomStatus


def test_a_watcher_sees_each_event_when_published_and_a_failing_one_stops_nothing() -> None:
    async def story() -> None:
        hub = EventHub()
        stream = hub.subscribe()
        seen: list[NodeEvent] = []

        def broken(event: NodeEvent) -> None:
            raise RuntimeError("this watcher is broken")

        hub.watch(broken)
        hub.watch(seen.append)
        events = [RoomStatus(0, 7, 0, KVPoll.WaitingForInput), RoomStatus(0, 7, 0, KVPoll.Success),
                  RoomClosed(0, 7, 0)]  # fmt: skip
        for number, event in enumerate(events, start=1):
            hub.publish(event)
            assert seen == events[:number], "a watcher must see the event inside publish()"
        assert [stream.receive_nowait() for _ in events] == events
        assert hub.status(0, 7) is None  # the hub's own bookkeeping still ran (closed room)
        hub.close()
        hub.publish(RoomStatus(0, 8, 0, KVPoll.Bootstrapping))
        assert len(seen) == len(events), "closing the hub drops its watchers"

    anyio.run(story)
