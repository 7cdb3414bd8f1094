"""The simulated network: FIFO links, reordering on demand, loss, duplication, partitions."""

from __future__ import annotations

from pdflow.core.protocol.messages import Abort, PeerId
from pdflow.sim.network import Envelope, Network

DECODE = PeerId("d:1", "i", 0)
PREFILL = PeerId("p:1", "i", 0)


def envelope(room: int, src: str = "d:1", to: PeerId = PREFILL) -> Envelope:
    return Envelope(src, to, Abort(room=room, generation=1, decode=DECODE, prefill=to), f"m{room}")


def test_fifo_link_offers_only_its_oldest_message() -> None:
    net = Network(reorder_within_link=False)
    for room in (1, 2, 3):
        net.send(envelope(room))
    assert net.deliverable() == [(("d:1", "p:1"), 0)]
    assert net.take(net.deliverable()[0]).message.room == 1


def test_reordering_link_offers_every_message() -> None:
    net = Network(reorder_within_link=True)
    for room in (1, 2, 3):
        net.send(envelope(room))
    assert len(net.deliverable()) == 3
    assert net.take((("d:1", "p:1"), 2)).message.room == 3
    assert [net.take(net.deliverable()[0]).message.room for _ in range(2)] == [1, 2]
    assert len(net) == 0


def test_drop_is_recorded_and_duplicate_delivers_twice() -> None:
    net = Network(reorder_within_link=False)
    net.send(envelope(1))
    net.send(envelope(2))
    dropped = net.drop((("d:1", "p:1"), 0))
    assert net.lost == [dropped] and len(net) == 1
    net.duplicate((("d:1", "p:1"), 0))
    assert [net.take(net.deliverable()[0]).message.room for _ in range(2)] == [2, 2]


def test_partition_holds_messages_until_healed() -> None:
    net = Network(reorder_within_link=False)
    net.send(envelope(1))
    net.partition("p:1", "d:1")
    assert net.deliverable() == [] and net.in_flight() == [(("d:1", "p:1"), 0)]
    net.heal()
    assert net.deliverable() == [(("d:1", "p:1"), 0)]


def test_a_host_partition_cuts_every_link_of_the_host_until_the_heal() -> None:
    net = Network(reorder_within_link=False)
    other = PeerId("10.0.0.2:7000", "i", 0)
    for src, to in (("10.0.1.1:8000", PeerId("10.0.0.1:7000", "i", 0)),
                    ("10.0.1.1:8001", PeerId("10.0.0.1:7001", "i", 1)),
                    ("10.0.1.1:8000", other)):  # fmt: skip
        net.send(envelope(1, src, to))
    net.partition_host("10.0.0.1")
    assert net.partitioned and net.host_cut("10.0.0.1:9000")
    assert net.is_cut(("10.0.0.1:7001", "10.0.1.1:8000")), "either direction, any port"
    assert net.deliverable() == [(("10.0.1.1:8000", "10.0.0.2:7000"), 0)], "another host's link"
    net.heal()
    assert not net.partitioned and len(net.deliverable()) == 3
