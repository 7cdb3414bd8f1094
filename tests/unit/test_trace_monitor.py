"""The spec monitor accepts a real trace and catches a transition the spec does not have."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pdflow.cli import main
from pdflow.spec import load_spec
from pdflow.trace.format import StepRecord
from pdflow.trace.merge import load_traces
from pdflow.trace.monitor import check_records
from tests.unit.trace_fixtures import lines_of, record_world, rewrite


def test_a_real_trace_follows_the_spec(tmp_path: Path) -> None:
    trace = load_traces([record_world(tmp_path / "world.jsonl")])
    report = check_records(trace.records, load_spec())
    assert report.ok, report.violations
    assert report.records == len(trace.records)
    machines = {machine for machine, _ in report.rows_seen}
    slots = {"PrefillRoomSlot", "DecodeRoomSlot"}
    assert machines == {"SenderRoom", "ReceiverRoom", "PageLedger", *slots}


def test_a_tampered_transition_is_caught_at_its_seq(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    index = next(
        i for i, line in enumerate(lines)
        if isinstance(line, StepRecord) and line.endpoint == "decode-0" and line.seq > 20
        and any(f.target == "SUCCESS" for f in line.fired)
    )  # fmt: skip
    record = lines[index]
    assert isinstance(record, StepRecord)
    # SUCCESS -> TRANSFERRING would be a resurrection: the spec has no such row.
    fired = tuple(
        msgspec.structs.replace(f, target="TRANSFERRING") if f.target == "SUCCESS" else f
        for f in record.fired
    )
    lines[index] = msgspec.structs.replace(record, fired=fired)
    tampered = rewrite(tmp_path / "tampered.jsonl", lines)
    report = check_records(load_traces([tampered]).records, load_spec())
    assert [(v.endpoint, v.seq, v.rule) for v in report.violations] == [
        ("decode-0", record.seq, "transition not in the spec")
    ]
    assert main(["trace", "check", str(tampered)]) == 1
    assert f"decode-0 seq {record.seq}" in capsys.readouterr().out
    assert main(["trace", "check", str(tmp_path / "world.jsonl")]) == 0
    assert "trace check OK" in capsys.readouterr().out


def test_a_poll_going_backwards_is_caught(tmp_path: Path) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    index = next(
        i for i, line in enumerate(lines)
        if isinstance(line, StepRecord) and line.endpoint == "prefill-0"
        and any(isinstance(r["summary"], dict) and r["summary"]["state"] == "SUCCESS"
                for r in line.rooms)
    )  # fmt: skip
    record = lines[index]
    assert isinstance(record, StepRecord)
    rooms = [
        {**entry, "summary": {**entry["summary"], "poll": 1}}
        if isinstance(entry["summary"], dict) and entry["summary"]["state"] == "SUCCESS"
        else entry
        for entry in record.rooms
    ]
    lines[index] = msgspec.structs.replace(record, rooms=rooms)
    report = check_records(load_traces([rewrite(tmp_path / "t.jsonl", lines)]).records, load_spec())
    assert [(v.seq, v.rule) for v in report.violations] == [(record.seq, "kvpoll_monotone")]
