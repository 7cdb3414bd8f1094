"""Table-driven machines: every transition is a row; anything else is a typed ProtocolError.

A row is ``(source, on, guard) -> target`` plus the names of the outputs it may emit and the
action that computes them. Guards and actions are bound by reference (the machine's own
``_guard_<name>`` / ``_act_<name>`` functions, typed by the row's input), never looked up by
name; the spec names them by ``<name>``, so the table still reads as data. Rows of one cell
(same source and input) are tried in order; only the last row of a cell may be unguarded. After
every step the machine checks itself against the row it took: the state it reached, the
outputs it emitted and the KVPoll monotonicity rule.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pdflow.core.framework.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll, poll_may_follow
from pdflow.core.framework.step import Fired, Step
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.outputs import Output, SendMessage, StatusChanged, emit_name

__all__ = ["STATUS_CHANGED", "ConformanceError", "Fired", "Row", "Table", "TableMachine", "row"]

S = TypeVar("S", bound=enum.Enum)
In = TypeVar("In", bound=Input)

GuardFn = Callable[[Any, Any, float], bool]
ActionFn = Callable[[Any, Any, float], list[Output]]
GUARD_PREFIX = "_guard_"
ACTION_PREFIX = "_act_"


STATUS_CHANGED = "status_changed"


class ConformanceError(RuntimeError):
    """The code did something its own table does not allow: a bug in pdflow, never in the caller."""


@dataclass(frozen=True)
class Row(Generic[S]):
    source: S
    on: str
    target: S
    guard: str | None = None
    emits: frozenset[str] = field(default_factory=frozenset)
    action: str = "nothing"
    guard_fn: GuardFn | None = field(default=None, compare=False, repr=False)
    action_fn: ActionFn | None = field(default=None, compare=False, repr=False)
    """The guard and action themselves, bound by reference (the spec names them ``guard`` and
    ``action``); a row without an action does nothing."""


def spec_name(fn: Callable[..., object], prefix: str) -> str:
    """The spec's name of a guard or action: its function name without the prefix."""
    name = fn.__name__
    if not name.startswith(prefix):
        raise ValueError(f"{fn.__qualname__} must be named {prefix}<name> to sit in a table row")
    return name[len(prefix) :]


def row(
    source: S,
    on: type[In],
    target: S,
    *,
    guard: Callable[[Any, In, float], bool] | None = None,
    emits: Iterable[str] = (),
    action: Callable[[Any, In, float], list[Output]] | None = None,
) -> Row[S]:
    """One transition. ``guard`` and ``action`` are the machine's own ``_guard_<name>`` and
    ``_act_<name>`` functions, typed by the row's input; the spec calls them ``<name>``."""
    guard_name = None if guard is None else spec_name(guard, GUARD_PREFIX)
    action_name = "nothing" if action is None else spec_name(action, ACTION_PREFIX)
    return Row(
        source, on.__name__, target, guard_name, frozenset(emits), action_name, guard, action
    )


@dataclass(frozen=True, slots=True)
class _Compiled(Generic[S]):
    """A row as one step uses it: the KVPoll it reports (None: unchanged) is worked out once."""

    row: Row[S]
    guard_fn: GuardFn | None
    action_fn: ActionFn | None
    target: S
    target_name: str
    status_poll: KVPoll | None
    backwards: str | None
    """Why the row breaks KVPoll monotonicity (only a mutated row can; tables refuse such rows)."""
    machine: str
    on: str
    guard: str | None
    """What a step's Fired record names besides the room and the source state, read once."""
    listed_outputs: set[type] = field(default_factory=set)
    """Output types (other than SendMessage) already found named in the row's ``emits``..."""
    listed_messages: set[type] = field(default_factory=set)
    """... and message types a SendMessage of the row already carried: the name of an output
    depends only on these types, so each is looked up against ``emits`` once per row."""


def _compile(r: Row[S], polls: dict[str, KVPoll] | None, machine: str) -> _Compiled[S]:
    status_poll: KVPoll | None = None
    backwards: str | None = None
    if polls is not None:
        before, after = polls[r.source.name], polls[r.target.name]
        status_poll = None if after is before else after
        if not poll_may_follow(before, after):
            backwards = f"KVPoll went {before.name} -> {after.name}"
    return _Compiled(
        r, r.guard_fn, r.action_fn, r.target, r.target.name, status_poll, backwards, machine, r.on,
        r.guard,
    )  # fmt: skip


class Table(Generic[S]):
    def __init__(
        self,
        machine: str,
        states: type[S],
        initial: S,
        inputs: Sequence[type[Input]],
        remote_inputs: Sequence[type[Input]],
        rows: Sequence[Row[S]],
        poll_of: Callable[[S], KVPoll] | None = None,
        hints: dict[str, str] | None = None,
        keyed_by_room: bool = True,
    ) -> None:
        self.machine = machine
        self.keyed_by_room = keyed_by_room
        """Whether an instance's ``key`` (in ``Fired`` and traces) is a room id; else it is a
        rank or 0, and its transitions concern the endpoint, not one room."""
        self.states = states
        self.initial = initial
        self.input_types = tuple(inputs)
        self.remote_input_types = tuple(remote_inputs)
        self.inputs = tuple(cls.__name__ for cls in inputs)
        self.remote_inputs = frozenset(cls.__name__ for cls in remote_inputs)
        self.rows = tuple(rows)
        self.poll_of = poll_of
        self.hints = dict(hints or {})
        """What to tell a local caller whose input has no transition, by input name."""
        cells: dict[tuple[str, str], list[Row[S]]] = {}
        for r in self.rows:
            if r.on not in self.inputs:
                raise ValueError(f"{machine}: row uses unknown input {r.on}")
            cells.setdefault((r.source.name, r.on), []).append(r)
        for (source, on), cell in cells.items():
            unguarded = [r for r in cell if r.guard is None]
            if len(unguarded) > 1 or (unguarded and cell[-1].guard is not None):
                raise ValueError(
                    f"{machine}: cell ({source}, {on}) needs at most one unguarded row, last"
                )
        self.poll_by_name: dict[str, KVPoll] | None = (
            None if poll_of is None else {state.name: poll_of(state) for state in states}
        )
        self._compiled: dict[tuple[str, str], tuple[_Compiled[S], ...]] = {}
        self._compiled_from: object = None
        self._by_input: dict[type, dict[str, tuple[_Compiled[S], ...]]] = {}
        """The compiled cells by input type, then by source state name (what a step looks up:
        no key tuple per step), filled per input type on first use from ``_compiled`` and
        emptied whenever ``_cells`` is replaced (``__setattr__``)."""
        # Keyed by state *name*: Enum hashing runs in Python and dominated the step cost.
        self._cells = {key: tuple(value) for key, value in cells.items()}
        self._check_status_rows(poll_of)

    def __setattr__(self, name: str, value: object) -> None:
        # Replacing the cells (a mutant swaps rows in, and back) empties the per-input cache,
        # so the next step compiles the rows now in the table: fire() reads that cache
        # without checking, on every step, that the cells it was built from are current.
        object.__setattr__(self, name, value)
        if name == "_cells":
            object.__setattr__(self, "_by_input", {})

    def _check_status_rows(self, poll_of: Callable[[S], KVPoll] | None) -> None:
        if poll_of is None:
            return
        for r in self.rows:
            if not poll_may_follow(poll_of(r.source), poll_of(r.target)):
                raise ValueError(
                    f"{self.machine}: row {r.source.name} --{r.on}--> {r.target.name} moves "
                    f"KVPoll {poll_of(r.source).name} -> {poll_of(r.target).name} backwards"
                )
            changes_poll = poll_of(r.source) is not poll_of(r.target)
            if changes_poll != (STATUS_CHANGED in r.emits):
                raise ValueError(
                    f"{self.machine}: row {r.source.name} --{r.on}--> {r.target.name} must list "
                    f"{STATUS_CHANGED!r} in emits exactly when the KVPoll changes"
                )

    def with_rows(self, rows: Sequence[Row[S]]) -> Table[S]:
        """The same machine with other rows (used to show that drift is caught)."""
        return Table(
            self.machine,
            self.states,
            self.initial,
            self.input_types,
            self.remote_input_types,
            rows,
            self.poll_of,
            self.hints,
        )

    def cell(self, state: S, on: str) -> tuple[Row[S], ...]:
        return self._cells.get((state._name_, on), ())

    def compiled_cells(self) -> dict[tuple[str, str], tuple[_Compiled[S], ...]]:
        """Every cell's rows with everything a step needs worked out once, not on every step.
        Rebuilt whenever ``_cells`` is replaced (a mutant swaps rows in by replacing it)."""
        cells = self._cells
        if cells is not self._compiled_from:
            self._compiled = {
                key: tuple(_compile(r, self.poll_by_name, self.machine) for r in rows)
                for key, rows in cells.items()
            }
            self._by_input = {}
            self._compiled_from = cells
        return self._compiled

    def cells_for_input(self, kind: type) -> dict[str, tuple[_Compiled[S], ...]]:
        """The compiled cells an input of this type may fire, by source state name. A table
        names its inputs by class name, so any class of that name gets the same cells."""
        on = kind.__name__
        by_source = {
            source: cell for (source, name), cell in self.compiled_cells().items() if name == on
        }
        self._by_input[kind] = by_source
        return by_source

    def transitions(self) -> set[tuple[str, str, str | None, str]]:
        return {(r.source.name, r.on, r.guard, r.target.name) for r in self.rows}

    def refusal(self, state: S, on: str, why: str = "") -> ProtocolError:
        kind = RemoteProtocolError if on in self.remote_inputs else LocalProtocolError
        hint = (
            "drop the message and count it"
            if on in self.remote_inputs
            else self.hints.get(on, "this call is not valid in this state; poll the room first")
        )
        return kind(
            why or "no transition for this input in this state",
            machine=self.machine,
            state=state.name,
            input_name=on,
            hint=hint,
        )


class TableMachine(Generic[S]):
    """Drives a table: find the cell, pick the first row whose guard holds, act, self-check."""

    table: Table[S]
    state: S
    key: int
    generation: int = 0
    reason: str = ""

    def timer_at(self) -> float | None:
        """The machine's next deadline; machines with timers override it."""
        return None

    def handle(self, inp: Input, now: float) -> Step:
        """Drive the machine alone; endpoints that combine machines call :meth:`fire`."""
        outputs, fired = self.fire(inp, now)
        return Step(tuple(outputs), self.timer_at(), (fired,))

    def _validate(self, inp: Input, now: float) -> None:
        """Raise InvalidInput or RemoteProtocolError for a malformed input (whatever the state)
        before anything changes. What the state decides is a guard. Override."""

    def _why_refused(self, inp: Input, now: float) -> str:
        """What to tell the caller when no row of the input's cell has a guard that holds (the
        table decided; this only explains). Override to name the broken expectation."""
        return ""

    def fire(self, inp: Input, now: float) -> tuple[list[Output], Fired]:
        table = self.table
        kind = type(inp)
        by_source = table._by_input.get(kind)
        if by_source is None:
            # (emptied when the cells are replaced: the rows now in the table are compiled)
            by_source = table.cells_for_input(kind)
        source = self.state._name_
        cell = by_source.get(source)
        if not cell:
            raise table.refusal(self.state, kind.__name__)
        self._validate(inp, now)
        for chosen in cell:
            check = chosen.guard_fn
            if check is None or check(self, inp, now):
                break
        else:
            raise table.refusal(self.state, kind.__name__, self._why_refused(inp, now))
        action = chosen.action_fn
        outputs = [] if action is None else action(self, inp, now)
        self.state = chosen.target
        if chosen.status_poll is not None:
            # The driver, not each action, reports poll changes: one place, never forgotten.
            change = StatusChanged(self.key, self.generation, chosen.status_poll, self.reason)
            outputs.append(change)
        if chosen.backwards is not None:
            raise ConformanceError(f"{table.machine}: {chosen.backwards}")
        if outputs:
            listed_outputs, listed_messages = chosen.listed_outputs, chosen.listed_messages
            for output in outputs:
                emitted = type(output)
                if emitted is SendMessage:
                    if type(output.message) in listed_messages:  # type: ignore[attr-defined]
                        continue
                elif emitted in listed_outputs:
                    continue
                if emit_name(output) not in chosen.row.emits:
                    raise self._emitted_outside_row(chosen.row, output)
                if emitted is SendMessage:
                    listed_messages.add(type(output.message))  # type: ignore[attr-defined]
                elif not issubclass(emitted, SendMessage):
                    listed_outputs.add(emitted)
        # Recorded under the machine's key (a room, for room machines); a machine serving
        # many rooms overrides fire() to name the input's room instead.
        fired = Fired(chosen.machine, self.key, source, chosen.on, chosen.guard, chosen.target_name)
        return outputs, fired

    def _emitted_outside_row(self, chosen: Row[S], output: Output) -> ConformanceError:
        return ConformanceError(
            f"{self.table.machine}: {chosen.source.name} --{chosen.on}--> "
            f"{chosen.target.name} emitted {emit_name(output)}, not in its row"
        )
