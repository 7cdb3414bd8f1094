"""The spec monitor: check a recorded trace against spec/protocol.toml, record by record.

Every fired transition ``(machine, from, on, guard, to)`` must be a row of the spec, and every
room summary must respect the KVPoll rule (only forward, Failed absorbing, Success sticky)
against the previous summary of the same room instance on the same endpoint. This is trace
validation in the style of etcd's TLA+ trace checks, with the transition table as the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdflow.core.framework.kvpoll import KVPoll, poll_may_follow
from pdflow.spec.load import Spec
from pdflow.trace.format import StepRecord

_Row = tuple[str, str, str | None, str]  # (from, on, guard, to)


@dataclass(frozen=True)
class Violation:
    endpoint: str
    seq: int
    t: float
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.endpoint} seq {self.seq} (t={self.t:.6f}): {self.rule}: {self.detail}"


@dataclass
class MonitorReport:
    records: int = 0
    transitions: int = 0
    violations: list[Violation] = field(default_factory=list)
    rows_seen: set[tuple[str, _Row]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.violations


def spec_rows(spec: Spec) -> dict[str, set[_Row]]:
    return {
        name: {(t.source, t.on, t.guard, t.to) for t in machine.table.transitions}
        for name, machine in spec.machines.items()
    }


def check_records(
    records: Iterable[StepRecord], spec: Spec, *, stop_at_first: bool = True
) -> MonitorReport:
    rows = spec_rows(spec)
    report = MonitorReport()
    polls: dict[tuple[str, int, int], KVPoll] = {}
    for record in records:
        report.records += 1
        found = _check_fired(record, rows, report) + _check_polls(record, polls)
        report.violations.extend(found)
        if found and stop_at_first:
            break
    return report


def _check_fired(
    record: StepRecord, rows: dict[str, set[_Row]], report: MonitorReport
) -> list[Violation]:
    found = []
    for fired in record.fired:
        report.transitions += 1
        row = (fired.source, fired.on, fired.guard, fired.target)
        machine_rows = rows.get(fired.machine)
        guard = f" [{fired.guard}]" if fired.guard else ""
        text = f"{fired.machine} room {fired.key}: {fired.source} --{fired.on}{guard}--> "
        if machine_rows is None:
            found.append(_violation(record, "unknown machine", text + fired.target))
        elif row not in machine_rows:
            found.append(_violation(record, "transition not in the spec", text + fired.target))
        else:
            report.rows_seen.add((fired.machine, row))
    return found


def _check_polls(record: StepRecord, polls: dict[tuple[str, int, int], KVPoll]) -> list[Violation]:
    found = []
    for entry in record.rooms:
        summary = entry.get("summary")
        if not isinstance(summary, dict):
            continue  # the room was removed by this step
        key = (record.endpoint, int(summary["room"]), int(summary["generation"]))
        after = KVPoll(summary["poll"])
        before = polls.get(key)
        if before is not None and not poll_may_follow(before, after):
            detail = f"room {key[1]} generation {key[2]}: KVPoll {before.name} -> {after.name}"
            found.append(_violation(record, "kvpoll_monotone", detail))
        polls[key] = after
    return found


def _violation(record: StepRecord, rule: str, detail: str) -> Violation:
    return Violation(record.endpoint, record.seq, record.t, rule, detail)
