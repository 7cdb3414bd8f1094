"""Table rows hold their guards and actions by reference; the spec names are derived from them."""

from __future__ import annotations

import enum
import inspect

import pytest

from pdflow.core.framework import table as table_module
from pdflow.core.framework.machines import MACHINES
from pdflow.core.framework.table import row
from pdflow.core.protocol.inputs import Input, Tick


def test_every_row_holds_its_guard_and_action_by_reference() -> None:
    for name, table in MACHINES.items():
        for r in table.rows:
            where = f"{name}: {r.source.name} --{r.on}--> {r.target.name}"
            assert (r.guard is None) == (r.guard_fn is None), where
            if r.guard_fn is not None:
                assert r.guard_fn.__name__ == f"_guard_{r.guard}", where
            if r.action_fn is None:
                assert r.action == "nothing", where
            else:
                assert r.action_fn.__name__ == f"_act_{r.action}", where


def test_the_driver_looks_nothing_up_by_name() -> None:
    source = inspect.getsource(table_module)
    assert "getattr" not in source and "cast(" not in source


class _State(enum.Enum):
    ONLY = "ONLY"


def test_a_guard_or_action_not_named_for_the_spec_is_refused() -> None:
    def ready(machine: object, inp: Input, now: float) -> bool:
        return True

    def go(machine: object, inp: Input, now: float) -> list[object]:
        return []

    with pytest.raises(ValueError, match="_guard_<name>"):
        row(_State.ONLY, Tick, _State.ONLY, guard=ready)
    with pytest.raises(ValueError, match="_act_<name>"):
        row(_State.ONLY, Tick, _State.ONLY, action=go)  # type: ignore[arg-type]
