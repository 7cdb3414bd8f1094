"""Compare the code's machine tables with the spec, in both directions, cell by cell."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.machines import MACHINES
from pdflow.core.framework.table import Table
from pdflow.core.protocol.policy import Timeouts
from pdflow.spec.load import Spec, SpecMachine

Row = tuple[str | None, str, tuple[str, ...]]  # guard, target, emits


class SpecDifference(msgspec.Struct, frozen=True):
    machine: str
    where: str
    in_spec: str
    in_code: str

    def __str__(self) -> str:
        return f"{self.machine}: {self.where}: spec={self.in_spec} code={self.in_code}"


def _cells_of_code(table: Table[Any]) -> dict[tuple[str, str], list[Row]]:
    cells: dict[tuple[str, str], list[Row]] = {}
    for r in table.rows:
        cells.setdefault((r.source.name, r.on), []).append(
            (r.guard, r.target.name, tuple(sorted(r.emits)))
        )
    return cells


def _cells_of_spec(machine: SpecMachine) -> dict[tuple[str, str], list[Row]]:
    cells: dict[tuple[str, str], list[Row]] = {}
    for t in machine.table.transitions:
        cells.setdefault((t.source, t.on), []).append((t.guard, t.to, tuple(sorted(t.emits))))
    return cells


def _fmt(rows: list[Row] | None) -> str:
    if not rows:
        return "(no transition)"
    return "; ".join(f"[{g or '-'}] -> {to} emits {list(em)}" for g, to, em in rows)


def _compare_machine(name: str, table: Table[Any], spec: SpecMachine) -> list[SpecDifference]:
    diffs: list[SpecDifference] = []

    def differ(where: str, in_spec: object, in_code: object) -> None:
        if in_spec != in_code:
            diffs.append(SpecDifference(name, where, str(in_spec), str(in_code)))

    poll_of = table.poll_of
    code_states = {s.name: poll_of(s).name if poll_of else "-" for s in table.states}
    differ("states (state -> KVPoll)", spec.states, code_states)
    differ("initial state", spec.initial, table.initial.name)
    differ("inputs", list(spec.inputs), list(table.inputs))
    differ("remote inputs", sorted(spec.remote_inputs), sorted(table.remote_inputs))
    code_guards = sorted({r.guard for r in table.rows if r.guard})
    differ("guards", sorted(spec.guards), code_guards)
    code_emits = sorted({e for r in table.rows for e in r.emits})
    differ("outputs", sorted(spec.outputs), code_emits)
    code_cells, spec_cells = _cells_of_code(table), _cells_of_spec(spec)
    for cell in sorted(set(code_cells) | set(spec_cells)):
        in_spec, in_code = spec_cells.get(cell), code_cells.get(cell)
        if in_spec != in_code:
            where = f"cell {cell[0]} x {cell[1]}"
            if in_spec and in_code and Counter(in_spec) == Counter(in_code):
                where += " (the same rows in another order; guards are tried in order)"
            diffs.append(SpecDifference(name, where, _fmt(in_spec), _fmt(in_code)))
    return diffs


def _compare_invariants(spec: Spec, checkers: Sequence[str] | None) -> list[SpecDifference]:
    if checkers is None:
        from pdflow.sim.invariants import INVARIANTS

        checkers = INVARIANTS
    ids = [inv.id for inv in spec.invariants]
    diffs = [
        SpecDifference("invariants", f"id {dup}", "listed twice", "-")
        for dup in sorted({i for i in ids if ids.count(i) > 1})
    ]
    for missing in sorted(set(ids) - set(checkers)):
        diffs.append(SpecDifference("invariants", f"id {missing}", "present", "(no checker)"))
    for unnamed in sorted(set(checkers) - set(ids)):
        diffs.append(
            SpecDifference("invariants", f"checker {unnamed}", "(no such invariant)", "present")
        )
    return diffs


def check_spec(
    spec: Spec,
    machines: dict[str, Table[Any]] | None = None,
    checkers: Sequence[str] | None = None,
) -> list[SpecDifference]:
    """Every difference between the spec and the code; empty when they agree.

    ``checkers`` are the invariant ids the model checker checks (default: those of
    :mod:`pdflow.sim.invariants`); every spec invariant needs one, and every one a spec id."""
    tables = MACHINES if machines is None else machines
    diffs: list[SpecDifference] = []
    diffs.extend(_compare_invariants(spec, checkers))
    differ_kvpoll = {p.name: int(p) for p in KVPoll}
    if spec.kvpoll != differ_kvpoll:
        diffs.append(SpecDifference("KVPoll", "values", str(spec.kvpoll), str(differ_kvpoll)))
    defaults = Timeouts()
    for timer_name, timer in spec.timers.items():
        budget = timer.same_budget_as or timer_name
        code_default = getattr(defaults, budget, None)
        if code_default != timer.default_s:
            diffs.append(
                SpecDifference(
                    f"timer {timer_name}", "default_s", str(timer.default_s), str(code_default)
                )
            )
    for name in sorted(set(tables) | set(spec.machines)):
        if name not in spec.machines:
            diffs.append(SpecDifference(name, "machine", "(absent)", "present"))
        elif name not in tables:
            diffs.append(SpecDifference(name, "machine", "present", "(absent)"))
        else:
            diffs.extend(_compare_machine(name, tables[name], spec.machines[name]))
    return diffs
