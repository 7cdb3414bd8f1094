"""`pdflow replay --room/--endpoint/--until/--all-steps/--json`: follow a recorded run step by
step through the real core, and read the replayed state where replay stops."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdflow.cli import main
from pdflow.core.endpoints.endpoint_io import TimerFired
from pdflow.trace.format import StepRecord, TraceHeader
from pdflow.trace.merge import load_traces
from pdflow.trace.observe import record_rooms
from pdflow.trace.replay import replay
from tests.unit.trace_fixtures import lines_of, record_world, rewrite


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_world(tmp_path_factory.mktemp("follow") / "world.jsonl")


def _records(path: Path) -> list[StepRecord]:
    return load_traces([path]).records


def _failed_room(path: Path) -> int:
    """A room that failed on the decode (an abort, a failed transfer or the timeout)."""
    for record in _records(path):
        for entry in record.rooms:
            summary = entry["summary"]
            if record.endpoint == "decode-0" and isinstance(summary, dict) \
                    and summary["state"] == "FAILED":  # fmt: skip
                return int(str(entry["room"]))
    raise AssertionError("the fixture world has no failed decode room")


def _run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["replay", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_stop_point_ends_replay_after_that_record_with_the_state_there(world: Path) -> None:
    trace = load_traces([world])
    index, record = next((i, r) for i, r in enumerate(trace.records)
                         if r.endpoint == "decode-0" and r.seq == 20)  # fmt: skip
    seen: list[tuple[str, int]] = []
    result = replay(trace, until=("decode-0", 20),
                    before_step=lambda r, _: seen.append((r.endpoint, r.seq)))  # fmt: skip
    assert result.ok and result.stopped and result.last is record
    assert result.records == index + 1 == len(seen)
    decode = result.endpoints["decode-0"]
    for entry in record.rooms:  # the state is the one right after that record
        assert msgspec.to_builtins(decode.summary(int(str(entry["room"])))) == entry["summary"]
    assert not replay(trace, until=(trace.records[-1].endpoint, trace.records[-1].seq)).stopped


def test_a_room_is_followed_on_every_endpoint_with_its_state_before_and_after_each_step(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    room = _failed_room(world)
    code, report = _run_json(capsys, str(world), "--room", str(room))
    assert code == 0 and report["verdict"] == "identical"
    records = _records(world)
    wanted = [(r.endpoint, r.seq) for r in records if room in record_rooms(r)]
    assert [(s["endpoint"], s["seq"]) for s in report["steps"]] == wanted
    assert {endpoint for endpoint, _ in wanted} == {"prefill-0", "decode-0"}
    # Before a step: the room's last recorded summary on that endpoint (null: not open there);
    # after it: what the record says, since replay matched it.
    last: dict[str, Any] = {}
    by_step = {(s["endpoint"], s["seq"]): s for s in report["steps"]}
    for record in records:
        view = by_step.get((record.endpoint, record.seq))
        recorded = {int(str(e["room"])): e["summary"] for e in record.rooms}
        if view is not None:
            [change] = view["rooms"]
            assert change == {"room": room, "before": last.get(record.endpoint),
                              "after": recorded[room]}  # fmt: skip
            assert all(f["key"] == room for f in view["fired"])
        if room in recorded:
            last[record.endpoint] = recorded[room]
    # At the end both sides have removed the room: the state says how each last saw it.
    holders = report["state"]["rooms"][str(room)]
    assert {h["endpoint"] for h in holders} == {"prefill-0", "decode-0"}
    decode = next(h for h in holders if h["endpoint"] == "decode-0")
    assert decode["summary"] is None and decode["last_seen"]["summary"]["state"] == "FAILED"


def test_the_text_shows_each_step_its_transitions_and_room_changes(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    room = _failed_room(world)
    assert main(["replay", str(world), "--room", str(room)]) == 0
    out = capsys.readouterr().out
    headers = re.findall(r"^(\S+) seq (\d+) t=\S+: (\w+)\(", out, flags=re.MULTILINE)
    records = {(r.endpoint, r.seq): r for r in _records(world)}
    assert headers and all(type(records[(e, int(s))].input).__name__ == kind
                           for e, s, kind in headers)  # fmt: skip
    assert re.search(rf"  fired    ReceiverRoom: \w+ -> FAILED on \w+.* \(key {room}\)", out)
    assert re.search(rf"  room     {room}/\d+: state \w+ -> FAILED; poll \w+ -> Failed", out)
    assert re.search(rf"  room     {room}/\d+ \w+ poll=\w+ .*\(opened\)", out)
    assert re.search(rf"  room     {room}: removed \(was {room}/\d+ FAILED", out)
    assert "replay OK: " in out and "state at the end of the trace:" in out
    assert re.search(r"  decode-0 \(decode\): not open; last seen at seq \d+ .* FAILED", out)


def test_an_endpoint_up_to_a_stop_point_and_its_state_there(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _run_json(capsys, str(world), "--endpoint", "decode-0",
                             "--until", "decode-0:30")  # fmt: skip
    assert code == 0 and report["verdict"] == "stopped"
    assert [s["seq"] for s in report["steps"]] == list(range(31))
    assert {s["endpoint"] for s in report["steps"]} == {"decode-0"}
    expected = replay(load_traces([world]), until=("decode-0", 30)).endpoints["decode-0"]
    state = report["state"]["endpoints"]["decode-0"]
    assert state["snapshot"] == json.loads(msgspec.json.encode(expected.snapshot()))
    assert state["timer_at"] == expected.timer_at() and state["room_timers"]
    assert report["state"]["at"]["seq"] == 30 and list(report["state"]["endpoints"]) == ["decode-0"]
    # --until alone: no steps, that endpoint's state, in text.
    assert main(["replay", str(world), "--until", "decode-0:30"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("replay stopped after decode-0 seq 30 ")
    open_rooms = expected.snapshot().rooms  # type: ignore[attr-defined]
    assert f"  open rooms: {len(open_rooms)}\n" in out and open_rooms
    for summary in open_rooms:
        assert f"    {summary.room}/{summary.generation} {summary.state} poll=" in out


def test_every_step_is_followed_with_all_steps(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _run_json(capsys, str(world), "--all-steps")
    assert code == 0 and len(report["steps"]) == report["records"] == len(_records(world))
    assert set(report["state"]["endpoints"]) == {"prefill-0", "decode-0"}


def test_a_divergence_shows_the_steps_before_it_and_the_state_they_agree_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    # The decode's transfer timeout: its step fails the room; edit what it recorded.
    index, record = next((i, line) for i, line in enumerate(lines)
                         if isinstance(line, StepRecord) and isinstance(line.input, TimerFired)
                         and line.endpoint == "decode-0" and line.fired)  # fmt: skip
    assert isinstance(record, StepRecord)
    [room] = record_rooms(record)
    lines[index] = msgspec.structs.replace(record, timer_at=12345.0)
    edited = rewrite(tmp_path / "edited.jsonl", lines)
    code, report = _run_json(capsys, str(edited), "--room", str(room))
    assert code == 1 and report["verdict"] == "diverged"
    assert (report["divergence"]["endpoint"], report["divergence"]["seq"]) == ("decode-0",
                                                                               record.seq)
    order = [(r.endpoint, r.seq) for r in lines if isinstance(r, StepRecord)]
    shown = [order.index((s["endpoint"], s["seq"])) for s in report["steps"]]
    assert shown and max(shown) < order.index(("decode-0", record.seq))
    # The state is the one before the diverging step (the room still transferring), not
    # the one this core's run of that step left (failed).
    [decode] = [h for h in report["state"]["rooms"][str(room)] if h["endpoint"] == "decode-0"]
    assert decode["summary"]["state"] == "TRANSFERRING"
    assert decode["timer_at"] == record.t
    assert main(["replay", str(edited), "--room", str(room)]) == 1
    out = capsys.readouterr().out
    steps_shown = len(report["steps"])
    assert f"(the {steps_shown} steps above were replayed by this pdflow's core" in out
    assert out.index("replay cannot go past it") < out.index("replay DIVERGED at endpoint")
    assert f"state where replay stopped, after the last matching step (before decode-0 seq " \
           f"{record.seq}):" in out  # fmt: skip


def test_options_the_trace_cannot_honour_are_refused_without_replaying(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args, says in [
        (["--room", "999"], "no record concerns room 999; the trace's rooms: 1, 2"),
        (["--endpoint", "decode-9"], "no endpoint decode-9 in this trace; its endpoints: "
                                     "prefill-0, decode-0"),
        (["--until", "decode-0"], "give ENDPOINT:SEQ, e.g. --until "),
        (["--until", "decode-0:x"], "give ENDPOINT:SEQ"),
        (["--until", "decode-0:100000"], "endpoint decode-0 has seq 0 to "),
        (["--until", "nobody:1"], "no endpoint nobody in this trace"),
    ]:  # fmt: skip
        assert main(["replay", str(world), *args]) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "" and says in captured.err, (args, captured.err)


def test_default_replay_prints_only_its_verdict(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(world)]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("replay OK: ") and "identical" in line


def test_a_trace_of_headers_alone_is_not_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    headers = [line for line in lines_of(record_world(tmp_path / "w.jsonl"))
               if isinstance(line, TraceHeader)]  # fmt: skip
    assert main(["replay", str(rewrite(tmp_path / "h.jsonl", headers)), "--room", "1"]) == 0


def test_a_caught_mutant_names_the_replay_of_its_room_and_that_replay_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdflow check` said "replay it step by step: pdflow replay TRACE", and that command
    printed one verdict line."""
    traces = tmp_path / "traces"
    assert main(["check", "--mutants", "--mutant", "ack_before_drain",
                 "--trace-dir", str(traces)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    acked = re.search(r"ACKed room (\d+)/\d+", out)
    hint = re.search(r"  step through room (\d+) as replayed: pdflow (replay \S+ --room \d+)\n",
                     out)  # fmt: skip
    assert acked and hint and hint.group(1) == acked.group(1)
    assert main(hint.group(2).split()) == 1  # the mutant's trace diverges from the real core
    replayed = capsys.readouterr().out
    assert re.search(r"^\S+ seq \d+ t=\S+: ", replayed, flags=re.MULTILINE)  # steps first
    assert "steps above were replayed by this pdflow's core and each matched its record" \
        in replayed  # fmt: skip
    assert "replay DIVERGED at endpoint " in replayed
    assert "recorded under mutant ack_before_drain: it diverges where the mutant acts" in replayed
    assert "state where replay stopped, after the last matching step" in replayed
    assert f"\nroom {acked.group(1)}:\n" in replayed


def test_a_violation_without_a_room_points_at_its_endpoint_or_every_step(
    world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflow.cli.check_cmd import replay_hint

    named = replay_hint(str(world), ["t=0: [duplicate_claim_fails] decode-0: OpenRoom was "
                                     "accepted, not refused"])  # fmt: skip
    assert named.endswith(f"pdflow replay {world} --endpoint decode-0")
    unnamed = replay_hint(str(world), ["t=0: [registry_ordered] the registry answered 200"])
    assert unnamed.endswith(f"pdflow replay {world} --all-steps")
    for hint in (named, unnamed):
        assert main(hint.split("pdflow ", 1)[1].split()) == 0
        assert "replay OK: " in capsys.readouterr().out
