"""What the decode knows about the liveness of its prefill instances (pure bookkeeping).

A prefill *instance* is what one heartbeat probe speaks for: the ranks that registered the same
health address (a pdflow PrefillNode serves its own), or, for ranks that registered none
(SGLang), every rank behind the registry's ``/health``. The probe key is that health address,
or the bootstrap address for the registry probe.

An instance declared dead is *lost*, not forgotten: it is still probed, and once it answers
again as the same incarnation (a paused process, a stalled registry) and owes no drain ACK, the
endpoint readmits it. An instance that another incarnation replaced is *superseded* and is
never readmitted. One that stays silent is given up (superseded too, and no longer probed)
``lost_instance_forget_s`` after the verdict once no room refers to it: in an elastic cluster
dead instances that nobody replaces would otherwise be kept and probed without bound.
"""

from __future__ import annotations

import msgspec

from pdflow.core.endpoints.endpoint_io import PrefillInfo
from pdflow.core.protocol.messages import PeerId, peer_order


class ProbeTarget(msgspec.Struct, frozen=True, order=True):
    """Where the shell probes: ``health`` (an instance's own address), else the registry."""

    bootstrap: str
    health: str | None = None

    @property
    def key(self) -> str:
        return self.health or self.bootstrap


class LostInstance(msgspec.Struct):
    """An instance declared dead that may yet prove it was only paused."""

    target: ProbeTarget
    peers: tuple[PeerId, ...]
    sessions: dict[PeerId, str | None]
    """Each writer's transport session when it was fenced, to lift that fence again."""
    lost_at: float
    """When it was declared dead (the core's clock)."""
    answered: bool = False
    """It answered a probe as the same incarnation since it was declared dead."""

    @property
    def incarnations(self) -> frozenset[str]:
        return frozenset(p.incarnation for p in self.peers)


def instances_of(info: PrefillInfo) -> dict[ProbeTarget, tuple[PeerId, ...]]:
    """Each probe target of a topology and the peers its answer speaks for."""
    groups: dict[ProbeTarget, set[PeerId]] = {}
    for rank in info.ranks:
        groups.setdefault(ProbeTarget(info.bootstrap, rank.health), set()).add(rank.peer)
    return {target: tuple(sorted(peers, key=peer_order)) for target, peers in groups.items()}


def replaced_in(info: PrefillInfo, lost: LostInstance) -> bool:
    """Whether the topology names another incarnation for one of the lost instance's ranks."""
    current = {r.peer.rank: r.peer for r in info.ranks}
    return any(current.get(p.rank) not in (None, p) for p in lost.peers)
