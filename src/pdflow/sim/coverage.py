"""Spec coverage: which transitions of the spec a set of runs actually took."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pdflow.core.framework.machines import MACHINES
from pdflow.sim.invariants import Transition

DRIVEN_MACHINES = ("SenderRoom", "ReceiverRoom", "PageLedger", "AdmissionQueue", "PrefillComplete")
"""Machines a World drives: the endpoints' rooms and ledger, the decode admission queue, and
the prefill_complete table its shell keeps. (The registry answers topology queries but is
exercised by its own tests; the staging ring is not part of the simulated data plane.)"""


PROTOCOL_MACHINES = ("SenderRoom", "ReceiverRoom", "PageLedger")
"""The machines whose every transition the model check must reach (worlds plus cell drives);
the admission queue and prefill-complete table are reported, and covered by their own tests."""


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
