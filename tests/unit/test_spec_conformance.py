"""The code's tables and spec/protocol.toml agree in both directions; drift is caught."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from pdflow.cli import main
from pdflow.core.framework.machines import MACHINES
from pdflow.core.framework.table import Table
from pdflow.spec import check_spec, load_spec, spec_path
from pdflow.spec.render import render_markdown

REPO = Path(__file__).resolve().parents[2]


def test_code_and_spec_agree() -> None:
    assert check_spec(load_spec()) == []


def test_every_code_machine_is_in_the_spec_and_back() -> None:
    assert set(load_spec().machines) == set(MACHINES)


def _mutated(table: Table, index: int, **changes: object) -> Table:
    rows = list(table.rows)
    rows[index] = dataclasses.replace(rows[index], **changes)
    return table.with_rows(rows)


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_changing_one_code_transition_is_caught(machine: str) -> None:
    table = MACHINES[machine]
    # Retarget one transition to another state with the same KVPoll, so the table stays valid.
    index, other = next(
        (i, s)
        for i, r in enumerate(table.rows)
        for s in table.states
        if s is not r.target
        and (table.poll_of is None or table.poll_of(s) is table.poll_of(r.target))
    )
    broken = _mutated(table, index, target=other)
    diffs = check_spec(load_spec(), {**MACHINES, machine: broken})
    assert diffs, "a retargeted transition must be reported"
    assert any(table.rows[index].source.name in d.where for d in diffs)


def test_changing_one_spec_transition_is_caught(tmp_path: Path) -> None:
    source = spec_path()
    shutil.copytree(source.parent, tmp_path / "spec")
    edited = tmp_path / "spec" / "protocol.toml"
    text = edited.read_text()
    needle = '{ from = "TRANSFERRING", on = "Tick", guard = "transfer_expired", to = "FAILED"'
    assert needle in text
    edited.write_text(text.replace(needle, needle.replace('to = "FAILED"', 'to = "SUCCESS"')))
    diffs = check_spec(load_spec(edited))
    assert [d.where for d in diffs] == ["cell TRANSFERRING x Tick"]
    assert main(["spec", "check", "--spec", str(edited)]) == 1


def test_spec_check_cli_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "check"]) == 0
    out = capsys.readouterr().out
    assert "spec check OK" in out and "transitions=" in out


def test_protocol_doc_is_not_stale() -> None:
    committed = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    assert committed == render_markdown(load_spec()), "run `pdflow spec render`"


def test_spec_defaults_match_the_code_defaults() -> None:
    from pdflow.core.protocol.policy import Timeouts

    spec = load_spec()
    assert spec.timers["bootstrap_timeout"].default_s == Timeouts().bootstrap_timeout == 300.0
    assert spec.timers["waiting_timeout"].default_s == Timeouts().waiting_timeout == 300.0
    assert spec.kvpoll == {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2,
                           "Transferring": 3, "Success": 4}


def _spec_copy(tmp_path: Path) -> Path:
    shutil.copytree(spec_path().parent, tmp_path / "spec")
    return tmp_path / "spec" / "protocol.toml"


RING_FILE = Path("machines") / "staging_ring.toml"
RING_ROW = '  { from = "EMPTY", on = "FreeRoom", to = "EMPTY", emits = [] },\n'


def test_a_row_added_to_either_side_alone_is_caught_and_its_file_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflow.core.framework.table import row
    from pdflow.core.resources.staging_ring import CheckReady, RingState

    table = MACHINES["StagingRing"]
    extra = row(RingState.EMPTY, CheckReady, RingState.EMPTY)
    widened = table.with_rows([*table.rows, extra])
    in_code = check_spec(load_spec(), {**MACHINES, "StagingRing": widened})
    cell = "cell EMPTY x CheckReady"
    assert [(d.where, d.in_spec) for d in in_code] == [(cell, "(no transition)")]
    edited = _spec_copy(tmp_path)
    ring = edited.parent / RING_FILE
    text = ring.read_text()
    assert RING_ROW in text
    ring.write_text(text.replace(RING_ROW, RING_ROW + RING_ROW.replace("FreeRoom", "CheckReady")))
    in_spec = check_spec(load_spec(edited))
    assert [(d.where, d.in_code) for d in in_spec] == [(cell, "(no transition)")]
    assert main(["spec", "check", "--spec", str(edited)]) == 1
    out = capsys.readouterr().out
    assert f"StagingRing ({ring}): {cell}: in the spec: [-] -> EMPTY" in out
    assert "change the code's table to match it" in out


def test_rows_in_another_order_are_named_as_such(tmp_path: Path) -> None:
    edited = _spec_copy(tmp_path)
    ring = edited.parent / RING_FILE
    tail = 'emits = ["watermark_advanced"] },\n'
    first = f'  {{ from = "OCCUPIED", on = "Free", guard = "frees_last", to = "EMPTY", {tail}'
    second = f'  {{ from = "OCCUPIED", on = "Free", guard = "frees_oldest", to = "OCCUPIED", {tail}'
    text = ring.read_text()
    assert first + second in text
    ring.write_text(text.replace(first + second, second + first))
    assert [d.where for d in check_spec(load_spec(edited))] == [
        "cell OCCUPIED x Free (the same rows in another order; guards are tried in order)"
    ]


def test_a_misspelt_key_is_refused_not_read_as_absent(tmp_path: Path) -> None:
    """`gaurd` would otherwise leave the row unguarded, which here agrees with the code."""
    edited = _spec_copy(tmp_path)
    ring = edited.parent / RING_FILE
    unguarded = '  { from = "EMPTY", on = "Free", to = "EMPTY", emits = [] },\n'
    text = ring.read_text()
    assert unguarded in text
    ring.write_text(text.replace(unguarded, unguarded.replace("[] }", '[], gaurd = "is_live" }')))
    with pytest.raises(ValueError, match=f"{ring}: machine StagingRing: malformed: .*`gaurd`"):
        load_spec(edited)


def test_a_spec_that_cannot_be_loaded_gets_a_clear_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    edited = _spec_copy(tmp_path)
    ring = edited.parent / RING_FILE
    ring.write_text(ring.read_text() + "garbage [\n")
    for spec, names in ((edited, f"{ring}: malformed TOML"),
                        (tmp_path / "missing.toml", "no protocol spec at"),
                        (tmp_path, "is a folder")):  # fmt: skip
        assert main(["spec", "check", "--spec", str(spec)]) == 2
        err = capsys.readouterr().err
        assert "cannot load the spec: " in err and names in err, err


def test_a_reader_that_stops_early_ends_the_output_quietly() -> None:
    """`pdflow spec check | head -1` must not end in a BrokenPipeError traceback."""
    import subprocess
    import sys

    checked = subprocess.Popen(
        [sys.executable, "-m", "pdflow.cli", "spec", "check"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert checked.stdout is not None and checked.stderr is not None
    checked.stdout.close()  # the reader is gone before the first line
    err = checked.stderr.read().decode()
    assert checked.wait(timeout=60) == 141 and "Traceback" not in err, err
