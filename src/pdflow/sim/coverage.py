"""Spec coverage: which transitions of the spec a set of runs actually took."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pdflow.core.framework.machines import MACHINES
from pdflow.sim.invariants import Transition

PROTOCOL_MACHINES = (
    "SenderRoom", "ReceiverRoom", "PrefillRoomSlot", "DecodeRoomSlot", "PageLedger",
)  # fmt: skip
"""The machines whose every transition the model check must reach (worlds plus cell drives):
the rooms, the endpoints' room slots and the page ledger."""

DRIVEN_MACHINES = (
    *PROTOCOL_MACHINES, "AdmissionQueue", "PrefillComplete", "LayoutAnnouncement", "DecodeLayout",
)  # fmt: skip
"""Machines a World drives: the protocol machines, the decode admission queue, the
prefill_complete table and the KV layout exchange (in the worlds whose decodes announce a
layout). (The registry answers topology queries but is exercised by its own tests; the
staging ring is not part of the simulated data plane.) These others are reported, and covered
by their own exhaustive tests."""


_NO_STAGING = "the simulated data plane has no staging ring"
_CELL_ONLY: dict[str, str] = {
    "ReceiverRoom: AWAITING_PAGES --StagingWait--> AWAITING_PAGES":
        f"only a room deferred for staging-ring space waits that way, and {_NO_STAGING}",
    "PageLedger: RESERVED --ReleaseUnpublished--> FREE":
        f"only the decode's staging path releases reserved pages it never published, and "
        f"{_NO_STAGING}",
    "ReceiverRoom: TRANSFERRING --SuccessArrived[completes_without_aux]--> FAILED":
        "a pdflow prefill refuses InitTransfer without an aux_index when a decode peer published "
        "an aux slot, so only a foreign prefill reports Success without the aux row",
    "PageLedger: FENCED --WriterDead[all_writers_cleared]--> FREE":
        "the endpoint declares a writer dead before its session can be reported closed (the row "
        "keeps the ledger right under any order of the two facts)",
    **{f"PageLedger: FENCED --SessionRetired{guard}--> {target}":
        "the simulated decode shell does not rotate its transport engine (fence by engine "
        "rotation is proven with real processes: tests/integration/test_nodes_rotation.py)"
        for guard, target in (("[all_writers_cleared]", "FREE"), ("", "FENCED"))},
    "PageLedger: FENCED --WriterReadmitted--> FENCED":
        "a world's writers all belong to its one prefill instance, lost and readmitted "
        "together once they owe no ACK: no room of theirs is still fenced by then",
    "PageLedger: RESERVED --Fence[no_writer_can_land]--> FREE":
        "no room resolves to a writer declared dead and not readmitted (its topology waits), "
        "and a room the loss fails is fenced before its writers are declared dead",
}  # fmt: skip
"""Protocol transitions no world can take through an endpoint, and why; the cell drives
(:mod:`pdflow.sim.cells`) take them."""


def cell_only() -> dict[str, str]:
    return dict(_CELL_ONLY)


def reachable_summary(reached: Counter[Transition], machines: Iterable[str]) -> str:
    """Coverage of the transitions a world can take through its endpoints."""
    names = list(machines)
    spec = {t for t in spec_transitions(names) if describe(t) not in _CELL_ONLY}
    hit = len(spec & set(reached))
    return f"{hit}/{len(spec)} reachable through endpoints ({100.0 * hit / len(spec):.1f}%)"


def spec_transitions(machines: Iterable[str] = DRIVEN_MACHINES) -> set[Transition]:
    found: set[Transition] = set()
    for name in machines:
        table = MACHINES[name]
        for source, on, guard, target in table.transitions():
            found.add((name, source, on, guard, target))
    return found


def missing(reached: Iterable[Transition], machines: Iterable[str] = DRIVEN_MACHINES) -> list[str]:
    """Spec transitions never reached, each as ``machine: FROM --On[guard]--> TO``."""
    return sorted(describe(t) for t in spec_transitions(machines) - set(reached))


def describe(t: Transition) -> str:
    machine, source, on, guard, target = t
    return f"{machine}: {source} --{on}{f'[{guard}]' if guard else ''}--> {target}"


def summary(reached: Counter[Transition], machines: Iterable[str] = DRIVEN_MACHINES) -> str:
    spec = spec_transitions(machines)
    hit = len(spec & set(reached))
    return f"{hit}/{len(spec)} spec transitions ({100.0 * hit / len(spec):.1f}%)"
