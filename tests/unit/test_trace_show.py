"""`pdflow trace show` stays bounded on many rooms and details the rooms asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdflow.cli import main
from pdflow.trace.merge import load_traces
from pdflow.trace.timeline import build_timelines
from tests.unit.trace_fixtures import SCRIPTS, record_world


def test_summary_is_bounded_and_lists_failures_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = record_world(tmp_path / "world.jsonl", SCRIPTS * 4)
    assert main(["trace", "show", str(trace), "--limit", "5"]) == 0
    out = capsys.readouterr().out
    rooms = len(SCRIPTS) * 4
    assert f"{rooms} rooms on 2 endpoints" in out
    assert f"{rooms - 5} more rooms not listed" in out
    listed = [line for line in out.splitlines() if "/1 " in line]
    assert len(listed) == 5
    assert "misuse" not in out and listed[0].split()[0] == "5/1"  # the refused-input room


def test_room_detail_shows_transitions_messages_transfers_and_timers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = record_world(tmp_path / "world.jsonl")
    timelines = build_timelines(load_traces([trace]))
    timeout_room = SCRIPTS.index("timeout") + 1
    assert timelines[timeout_room].outcome == "Failed"
    assert main(["trace", "show", str(trace), "--room", str(timeout_room), "--room", "4"]) == 0
    out = capsys.readouterr().out
    assert f"room {timeout_room}: Failed" in out and "room 4: Failed" in out
    assert "timer fired" in out and "Tick [transfer_expired]" in out
    assert "transfer #0 done: FAILED (injected link failure)" in out
    assert "sends abort to prefill-0" in out and "received abort_ack" in out
    assert main(["trace", "show", str(trace), "--room", "999"]) == 2


def test_timelines_hold_only_rooms_and_keep_a_reused_ids_failed_attempt(tmp_path: Path) -> None:
    """A model-checker world: layout announcements are keyed by rank (never a room), and a
    room id whose first attempt failed and whose next succeeded reads Failed->Success."""
    from pdflow.sim.runner import run_seed

    _, world = run_seed(1, 150)
    assert world.trace is not None
    timelines = build_timelines(load_traces([world.trace.write(tmp_path / "world.jsonl")]))
    assert timelines
    for timeline in timelines.values():
        assert any(e.kind == "open" for e in timeline.events), f"room {timeline.room}: no open"
    retried = [t for t in timelines.values() if len(t.generations) > 1]
    assert sorted(t.outcome for t in retried) == ["Failed", "Failed->Success"]
    assert all(t.failed for t in retried)


def test_an_empty_trace_or_a_bad_spec_is_refused_not_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for command in (["replay"], ["trace", "check"], ["trace", "show"]):
        assert main([*command, str(empty)]) == 2, command
        assert "no pdflow trace header" in capsys.readouterr().err
    trace = str(record_world(tmp_path / "world.jsonl"))
    for spec in (tmp_path / "missing.toml", tmp_path):
        assert main(["trace", "check", trace, "--spec", str(spec)]) == 2
        assert f"cannot load the spec {spec}" in capsys.readouterr().err


def test_a_crashed_nodes_torn_last_line_is_dropped_with_a_warning_and_nothing_else_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = record_world(tmp_path / "world.jsonl")
    whole = trace.read_bytes()
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(whole + b'{"kind":"step","seq":9')  # died in the middle of a write
    assert main(["replay", str(torn)]) == 0
    assert "dropped the torn last line" in capsys.readouterr().err
    inside = tmp_path / "inside.jsonl"
    inside.write_bytes(whole + b'{"kind":"step","seq":9\n' + whole.splitlines(True)[-1])
    assert main(["replay", str(inside)]) == 2  # a bad line with more after it is corruption
    assert "not a trace line" in capsys.readouterr().err


def test_a_narrow_terminal_keeps_room_ids_and_outcomes_whole(tmp_path: Path) -> None:
    """What --room takes must stay readable; the per-endpoint columns give way instead."""
    from rich.console import Console

    from pdflow.trace.timeline_text import render_summary, short_endpoint

    timelines = build_timelines(load_traces([record_world(tmp_path / "world.jsonl")]))
    endpoints = [f"{role}-{'0123456789abcdef' * 2}#{rank}" for role in ("prefill", "decode")
                 for rank in (0, 1)]  # four wide columns, as TP=2 pairs give  # fmt: skip
    console = Console(width=80, record=True)
    render_summary(console, timelines, endpoints, limit=len(timelines))
    out = console.export_text()
    for timeline in timelines.values():
        assert f" {timeline.room}/" in out and timeline.outcome in out
    assert short_endpoint("prefill-49cf00126055a1b2#1") == "pre#1 49cf0012"
    assert short_endpoint("prefill-0") == "prefill-0"


def test_trace_check_says_when_records_are_missing_or_the_spec_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import msgspec

    from pdflow.trace.format import StepRecord, TraceHeader
    from tests.unit.trace_fixtures import lines_of, rewrite

    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    gap = [line for line in lines if not (isinstance(line, StepRecord) and line.seq in (3, 4))]
    other_spec = [msgspec.structs.replace(line, spec_sha256="0" * 64)
                  if isinstance(line, TraceHeader) else line for line in lines]  # fmt: skip
    assert main(["trace", "check", str(rewrite(tmp_path / "gap.jsonl", gap))]) == 0
    assert "records from seq 3 to 4 are missing" in capsys.readouterr().err
    assert main(["trace", "check", str(rewrite(tmp_path / "spec.jsonl", other_spec))]) == 0
    assert "recorded against spec" in capsys.readouterr().err
    assert main(["trace", "check", str(tmp_path / "world.jsonl")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_spliced_clock_is_warned_of_and_a_header_with_a_foreign_role_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import msgspec

    from pdflow.trace.format import StepRecord, TraceHeader
    from tests.unit.trace_fixtures import lines_of, rewrite

    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    late = next(line for line in lines if isinstance(line, StepRecord) and line.seq == 5)
    spliced = [msgspec.structs.replace(line, t=line.t - 1000.0) if line is late else line
               for line in lines]  # fmt: skip
    assert main(["trace", "check", str(rewrite(tmp_path / "spliced.jsonl", spliced))]) == 0
    assert f"endpoint {late.endpoint}: the clock goes back at seq 5" in capsys.readouterr().err
    router = [msgspec.structs.replace(line, role="router") if isinstance(line, TraceHeader)
              else line for line in lines]  # fmt: skip
    assert main(["trace", "show", str(rewrite(tmp_path / "router.jsonl", router))]) == 2
    err = capsys.readouterr().err
    assert "role 'router' does not match its" in err and "Traceback" not in err


def test_folders_and_bad_numbers_get_a_clear_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(record_world(tmp_path / "world.jsonl"))
    assert main(["trace", "show", str(tmp_path)]) == 2
    assert f"give its files: {tmp_path}/*.jsonl" in capsys.readouterr().err
    assert main(["trace", "show", trace, "--html", str(tmp_path)]) == 2
    assert "is a folder; name the page" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "show", trace, "--limit", "-1"])
    assert "must be at least 1" in capsys.readouterr().err
    assert main(["check", "--examples", "1", "--trace-dir", trace]) == 2
    assert "is a file; give a folder" in capsys.readouterr().out


def test_a_trace_of_headers_alone_is_said_to_hold_nothing_not_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Headers without a single step are nothing to replay: "replay OK: 0 records" would pass
    for a checked trace. Not a failure either: a process killed at once leaves such a file."""
    from pdflow.trace.format import TraceHeader
    from tests.unit.trace_fixtures import lines_of, rewrite

    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    only = [line for line in lines if isinstance(line, TraceHeader)]
    headers = rewrite(tmp_path / "headers.jsonl", only)
    for command, verb in ((["replay"], "replay"), (["trace", "check"], "check"),
                          (["trace", "show"], "show")):  # fmt: skip
        assert main([*command, str(headers)]) == 0, command
        out = capsys.readouterr().out
        assert out.startswith(f"nothing to {verb}: endpoint headers but no step record "
                              "(prefill-0, decode-0)"), out  # fmt: skip
        assert "OK" not in out and "rooms on" not in out


def test_every_trace_command_says_which_senders_files_are_missing_or_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflow.trace.format import StepRecord
    from pdflow.trace.recorder import TraceRecorder
    from pdflow.trace.synthetic import DECODE_ID, PREFILL_ID, SyntheticWorld
    from tests.unit.trace_fixtures import lines_of, rewrite

    prefill_file, decode_file = tmp_path / "prefill.jsonl", tmp_path / "decode.jsonl"
    with (
        TraceRecorder(prefill_file, clock="virtual") as prefill,
        TraceRecorder(decode_file, clock="virtual") as decode,
    ):
        SyntheticWorld({PREFILL_ID: prefill, DECODE_ID: decode}, SCRIPTS, seed=7).run()
    kept = [line for line in lines_of(prefill_file)
            if not isinstance(line, StepRecord) or line.seq < 10]  # fmt: skip
    cut = rewrite(tmp_path / "cut.jsonl", kept)
    for command in (["replay"], ["trace", "check"], ["trace", "show"]):
        assert main([*command, str(decode_file)]) == 0, command
        err = capsys.readouterr().err
        assert "received from prefill-0, whose trace is not among these files" in err, command
        assert main([*command, str(cut), str(decode_file)]) == 0, command
        err = capsys.readouterr().err
        assert "endpoint prefill-0: its records end at seq 9, but a message it sent" in err
        assert main([*command, str(prefill_file), str(decode_file)]) == 0, command
        assert "warning" not in capsys.readouterr().err


def test_show_says_when_records_are_missing_or_the_clock_goes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import msgspec

    from pdflow.trace.format import StepRecord
    from tests.unit.trace_fixtures import lines_of, rewrite

    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    gap = [line for line in lines if not (isinstance(line, StepRecord) and line.seq in (3, 4))]
    assert main(["trace", "show", str(rewrite(tmp_path / "gap.jsonl", gap))]) == 0
    assert "records from seq 3 to 4 are missing" in capsys.readouterr().err
    spliced = [msgspec.structs.replace(line, t=line.t - 1000.0)
               if isinstance(line, StepRecord) and line.seq == 5 else line
               for line in lines]  # fmt: skip
    assert main(["trace", "show", str(rewrite(tmp_path / "spliced.jsonl", spliced))]) == 0
    assert "the clock goes back at seq 5" in capsys.readouterr().err
