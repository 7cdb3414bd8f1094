"""One invariant list: spec/protocol.toml names every invariant by id, the model checker checks
each one under that id, tests that check one carry it, and `pdflow spec check` fails on drift."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from pdflow.cli import main
from pdflow.sim.invariants import INVARIANTS, Monitor
from pdflow.sim.runner import run_seed
from pdflow.spec import check_spec, load_spec, spec_path

REPO = Path(__file__).resolve().parents[2]
SIM = REPO / "src" / "pdflow" / "sim"


def spec_ids() -> set[str]:
    return {inv.id for inv in load_spec().invariants}


def test_the_spec_and_the_checker_name_the_same_invariants() -> None:
    assert spec_ids() == set(INVARIANTS)
    assert len(INVARIANTS) == len(set(INVARIANTS))
    assert not [d for d in check_spec(load_spec()) if d.machine == "invariants"]


def test_spec_check_fails_for_a_spec_invariant_without_a_checker(tmp_path: Path) -> None:
    shutil.copytree(spec_path().parent, tmp_path / "spec")
    edited = tmp_path / "spec" / "protocol.toml"
    text = edited.read_text()
    extra = '[[invariants]]\nid = "pages_never_leak"\ntext = "No page is ever lost."\n\n'
    edited.write_text(text.replace("[registry]", extra + "[registry]", 1))
    diffs = check_spec(load_spec(edited))
    assert [(d.where, d.in_code) for d in diffs] == [("id pages_never_leak", "(no checker)")]
    assert main(["spec", "check", "--spec", str(edited)]) == 1


def test_spec_check_fails_for_a_checker_that_names_no_spec_invariant() -> None:
    diffs = check_spec(load_spec(), checkers=(*INVARIANTS, "made_up"))
    assert [(d.where, d.in_spec) for d in diffs] == [("checker made_up", "(no such invariant)")]


def test_a_violation_must_name_a_spec_invariant() -> None:
    _, world = run_seed(0, 1, record=False)
    monitor = Monitor(world)
    with pytest.raises(ValueError, match="not an invariant"):
        monitor.fail("made_up", "x")
    monitor.fail("no_use_after_free", "a write landed in a free page")
    assert monitor.violations == ["t=0: [no_use_after_free] a write landed in a free page"]


def _ids_checked_in(source: str) -> set[str]:
    """Ids passed to fail(...) (first argument), chosen in a ternary before it, or opening a
    liveness problem as ``[id]``."""
    found = set(re.findall(r"\[([a-z_]+)\] ", source))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "fail" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
        if isinstance(node, ast.IfExp):
            for branch in (node.body, node.orelse):
                if isinstance(branch, ast.Constant) and isinstance(branch.value, str):
                    found.add(branch.value)
    return found & set(INVARIANTS)


def test_every_invariant_has_a_check_that_reports_it() -> None:
    checked: set[str] = set()
    for path in SIM.glob("*.py"):
        checked |= _ids_checked_in(path.read_text(encoding="utf-8"))
    assert sorted(set(INVARIANTS) - checked) == []


def test_tests_that_check_an_invariant_carry_spec_ids() -> None:
    marked: set[str] = set()
    pattern = re.compile(r"pytest\.mark\.invariant\(([^)]*)\)")
    for path in (REPO / "tests").rglob("*.py"):
        for args in pattern.findall(path.read_text(encoding="utf-8")):
            marked |= set(re.findall(r'"([a-z_]+)"', args))
    assert marked, "no test carries an invariant id"
    assert sorted(marked - spec_ids()) == []
