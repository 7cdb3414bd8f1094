"""A simulated control network: one FIFO queue per directed link, with faults on demand.

Every fault is a choice the driver makes: deliver any deliverable message (of any link; of any
position in a link too when the plan lets links reorder), drop one, duplicate one, cut links
(partition), drop a whole host off the network (every link to or from an address on it is cut
at once: :meth:`Network.partition_host`) and heal them all. Messages on a cut link wait; they
are delivered after the heal, and no late copy of a message crosses a cut link either
(:meth:`Network.passes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdflow.core.protocol.messages import AnyMessage, PeerId

Link = tuple[str, str]


def host_of(address: str) -> str:
    """The host of an ``ip:port`` address: what a host-level partition cuts off."""
    return address.rsplit(":", 1)[0]


RECENT = 16
"""Delivered messages kept for late redelivery."""


@dataclass(frozen=True)
class Envelope:
    src: str
    to: PeerId
    message: AnyMessage
    msg_id: str | None

    @property
    def link(self) -> Link:
        return (self.src, self.to.address)


@dataclass
class Network:
    reorder_within_link: bool
    queues: dict[Link, list[Envelope]] = field(default_factory=dict)
    cut: set[frozenset[str]] = field(default_factory=set)
    cut_hosts: set[str] = field(default_factory=set)
    """Hosts dropped off the network: every link with an end on one of them is cut."""
    lost: list[Envelope] = field(default_factory=list)
    """Every message dropped, in order (the liveness check forgives what they explain)."""
    sent: int = 0
    recent: list[Envelope] = field(default_factory=list)
    """The last messages delivered: a link may deliver one again, late (a retransmission that
    crosses the original, a proxy that replays)."""

    def send(self, envelope: Envelope) -> None:
        self.sent += 1
        self.queues.setdefault(envelope.link, []).append(envelope)

    def is_cut(self, link: Link) -> bool:
        return frozenset(link) in self.cut or any(self.host_cut(end) for end in link)

    def host_cut(self, address: str) -> bool:
        """Whether the host of ``address`` is off the network."""
        return host_of(address) in self.cut_hosts

    @property
    def partitioned(self) -> bool:
        """Some link or host is cut: a heal would change something."""
        return bool(self.cut or self.cut_hosts)

    def passes(self, envelope: Envelope) -> bool:
        """Whether a copy of this message could arrive now (a late copy crosses no cut link)."""
        return not self.is_cut(envelope.link)

    def in_flight(self) -> list[tuple[Link, int]]:
        """Every queued message as (link, position), in a deterministic order."""
        return [(link, i) for link in sorted(self.queues) for i in range(len(self.queues[link]))]

    def deliverable(self) -> list[tuple[Link, int]]:
        found: list[tuple[Link, int]] = []
        for link in sorted(self.queues):
            queue = self.queues[link]
            if not queue or self.is_cut(link):
                continue
            positions = range(len(queue)) if self.reorder_within_link else range(1)
            found.extend((link, i) for i in positions)
        return found

    def take(self, where: tuple[Link, int]) -> Envelope:
        link, position = where
        envelope = self.queues[link].pop(position)
        if not self.queues[link]:
            del self.queues[link]
        return envelope

    def delivered(self, envelope: Envelope) -> None:
        self.recent = [*self.recent[-(RECENT - 1) :], envelope]

    def redeliver(self, index: int) -> Envelope:
        """Queue a message delivered before once more, behind what its link holds now."""
        envelope = self.recent[index]
        self.send(envelope)
        return envelope

    def drop(self, where: tuple[Link, int]) -> Envelope:
        envelope = self.take(where)
        self.lost.append(envelope)
        return envelope

    def duplicate(self, where: tuple[Link, int]) -> Envelope:
        link, position = where
        envelope = self.queues[link][position]
        self.queues[link].insert(position + 1, envelope)
        return envelope

    def partition(self, a: str, b: str) -> None:
        self.cut.add(frozenset((a, b)))

    def partition_host(self, host: str) -> None:
        """The host drops off the network: every link of every address on it is cut."""
        self.cut_hosts.add(host)

    def heal(self) -> None:
        self.cut.clear()
        self.cut_hosts.clear()

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())
