"""Record a run of real endpoints, replay it identically, and catch every kind of tampering."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from pdflow.cli import main
from pdflow.core.endpoints.endpoint_io import ClearRoom, OpenReceiver, Received, TimerFired
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.trace.format import StepRecord, TraceHeader
from pdflow.trace.merge import load_traces
from pdflow.trace.observe import input_rooms, record_rooms
from pdflow.trace.replay import ReplayRefused, replay
from tests.unit.trace_fixtures import SCRIPTS, lines_of, record_world, rewrite


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    return record_world(tmp_path / "world.jsonl")


def test_recorded_world_covers_aborts_failures_timeouts_and_refusals(trace_file: Path) -> None:
    lines = lines_of(trace_file)
    headers = [line for line in lines if isinstance(line, TraceHeader)]
    records = [line for line in lines if isinstance(line, StepRecord)]
    assert [h.endpoint for h in headers] == ["prefill-0", "decode-0"]
    assert all(h.clock == "virtual" and h.seed == 7 for h in headers)
    assert headers[0].fault_plan == {"scripts": SCRIPTS, "spacing": 0.002}
    errors = [r for r in records if r.error is not None]
    assert [e.error.kind for e in errors if e.error] == ["LocalProtocolError"]
    fired = {(f.machine, f.source, f.on, f.target) for r in records for f in r.fired}
    assert ("ReceiverRoom", "TRANSFERRING", "AbortRequested", "FAILED") in fired
    assert ("SenderRoom", "TRANSFERRING", "TransferCompleted", "FAILED") in fired
    assert ("ReceiverRoom", "TRANSFERRING", "Tick", "FAILED") in fired  # the timeout room
    assert ("PageLedger", "FENCED", "AckArrived", "FREE") in fired
    received = [r.input for r in records if isinstance(r.input, Received)]
    assert received and all(inp.msg_id for inp in received)
    per_endpoint: dict[str, list[int]] = {}
    for record in records:
        per_endpoint.setdefault(record.endpoint, []).append(record.seq)
    assert all(seqs == list(range(len(seqs))) for seqs in per_endpoint.values())


def test_replay_reproduces_every_step(trace_file: Path) -> None:
    trace = load_traces([trace_file])
    result = replay(trace)
    assert result.ok, result.divergence
    assert result.records == len(trace.records) > 100
    snapshots = result.snapshots()
    decode = snapshots["decode-0"]
    # Every room was cleared and every page came back: the final state is the idle state.
    assert decode.rooms == () and decode.ledger.rooms == ()  # type: ignore[attr-defined]
    assert snapshots["prefill-0"].rooms == ()  # type: ignore[attr-defined]


def test_a_changed_output_is_reported_at_exactly_its_record(tmp_path: Path) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    target = _record_with_outputs(lines, "prefill-0", after_seq=40)
    record = lines[target]
    assert isinstance(record, StepRecord)
    outputs = [dict(o) for o in record.outputs]
    outputs[0] = {**outputs[0], "generation": 99}
    lines[target] = msgspec.structs.replace(record, outputs=outputs)
    result = replay(load_traces([rewrite(tmp_path / "tampered.jsonl", lines)]))
    assert result.divergence is not None
    assert (result.divergence.endpoint, result.divergence.seq) == ("prefill-0", record.seq)
    assert [d.field for d in result.divergence.diffs] == ["outputs"]
    assert result.divergence.diffs[0].expected[0]["generation"] == 99
    assert result.divergence.diffs[0].got[0]["generation"] != 99


def test_a_changed_input_time_diverges_where_its_effect_shows(tmp_path: Path) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    index = next(
        i for i, line in enumerate(lines)
        if isinstance(line, StepRecord) and isinstance(line.input, OpenReceiver)
    )  # fmt: skip
    record = lines[index]
    assert isinstance(record, StepRecord)
    lines[index] = msgspec.structs.replace(record, t=record.t + 1.0)
    result = replay(load_traces([rewrite(tmp_path / "tampered.jsonl", lines)]))
    assert result.divergence is not None
    assert (result.divergence.endpoint, result.divergence.seq) == (record.endpoint, record.seq)
    assert "timer_at" in [d.field for d in result.divergence.diffs]


def test_replay_refuses_another_spec_unless_forced(tmp_path: Path) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    lines = [
        msgspec.structs.replace(line, spec_sha256="0" * 64)
        if isinstance(line, TraceHeader) else line
        for line in lines
    ]  # fmt: skip
    trace = load_traces([rewrite(tmp_path / "old-spec.jsonl", lines)])
    with pytest.raises(ReplayRefused, match="different protocol spec"):
        replay(trace)
    forced = replay(trace, force=True)
    assert forced.ok and forced.skipped_spec_check


def test_replay_refuses_a_trace_with_missing_records(tmp_path: Path) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    dropped = _record_with_outputs(lines, "decode-0", after_seq=5)
    missing_seq = lines[dropped].seq  # type: ignore[union-attr]
    del lines[dropped]
    trace = load_traces([rewrite(tmp_path / "gap.jsonl", lines)])
    assert trace.gaps == {"decode-0": (missing_seq, missing_seq + 1)}
    with pytest.raises(ReplayRefused, match=f"from seq {missing_seq} are missing"):
        replay(trace)


def test_replay_command_exit_codes_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = record_world(tmp_path / "world.jsonl")
    assert main(["replay", str(good)]) == 0
    assert "replay OK" in capsys.readouterr().out
    lines = lines_of(good)
    target = _record_with_outputs(lines, "decode-0", after_seq=10)
    record = lines[target]
    assert isinstance(record, StepRecord)
    lines[target] = msgspec.structs.replace(record, timer_at=12345.0)
    assert main(["replay", str(rewrite(tmp_path / "bad.jsonl", lines))]) == 1
    out = capsys.readouterr().out
    assert f"DIVERGED at endpoint decode-0 seq {record.seq}" in out
    assert "timer_at:" in out and "expected: 12345.0" in out
    assert main(["replay", str(tmp_path / "absent.jsonl")]) == 2


def test_final_poll_of_each_room_is_in_the_last_summary(trace_file: Path) -> None:
    trace = load_traces([trace_file])
    last: dict[tuple[str, int], object] = {}
    for record in trace.records:
        for entry in record.rooms:
            last[(record.endpoint, int(str(entry["room"])))] = entry["summary"]
    # Every room ends removed on both endpoints (summary null), except none left open.
    assert all(summary is None for summary in last.values())
    polls = {
        KVPoll(int(str(o["poll"]))) for r in trace.records for o in r.outputs
        if o["type"] == "status_changed"
    }  # fmt: skip
    assert KVPoll.Failed in polls and KVPoll.Success in polls


def _record_with_outputs(
    lines: list[TraceHeader | StepRecord], endpoint: str, after_seq: int
) -> int:
    return next(
        i for i, line in enumerate(lines)
        if isinstance(line, StepRecord) and line.endpoint == endpoint and line.seq >= after_seq
        and line.outputs
    )  # fmt: skip


def _clear_then_open(lines: list[TraceHeader | StepRecord], endpoint: str) -> tuple[int, int]:
    """An engine clearing one room, then opening another: in the other order (seqs swapped
    with them) every step gives the same outputs, so only the clock can tell."""
    steps = [i for i, line in enumerate(lines)
             if isinstance(line, StepRecord) and line.endpoint == endpoint]  # fmt: skip
    for first, second in itertools.pairwise(steps):
        a, b = lines[first], lines[second]
        assert isinstance(a, StepRecord) and isinstance(b, StepRecord)
        if isinstance(a.input, ClearRoom) and isinstance(b.input, OpenReceiver) and b.t > a.t:
            return first, second
    raise AssertionError(f"{endpoint} never clears a room and then opens one")


def test_records_put_in_another_order_diverge_where_the_clock_goes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    first, second = _clear_then_open(lines, "decode-0")
    a, b = lines[first], lines[second]
    assert isinstance(a, StepRecord) and isinstance(b, StepRecord)
    lines[first], lines[second] = (msgspec.structs.replace(b, seq=a.seq),
                                   msgspec.structs.replace(a, seq=b.seq))  # fmt: skip
    result = replay(load_traces([rewrite(tmp_path / "reordered.jsonl", lines)]))
    assert result.divergence is not None
    assert (result.divergence.endpoint, result.divergence.seq) == ("decode-0", b.seq)
    assert [(d.field, d.expected, d.got) for d in result.divergence.diffs] == [("t", b.t, a.t)]
    assert main(["replay", str(tmp_path / "reordered.jsonl")]) == 1
    out = capsys.readouterr().out
    assert f"t: recorded at {a.t}, before seq {a.seq} of the same endpoint (t={b.t})" in out
    assert "what to do: records of decode-0 were reordered or spliced" in out


def test_a_divergence_says_what_to_do_and_where_to_look(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    target = _record_with_outputs(lines, "decode-0", after_seq=10)
    record = lines[target]
    assert isinstance(record, StepRecord)
    lines[target] = msgspec.structs.replace(record, timer_at=12345.0)
    edited = rewrite(tmp_path / "edited.jsonl", lines)
    assert main(["replay", str(edited)]) == 1
    out = capsys.readouterr().out
    # A simulated world (virtual clock, a seed): a mutant core is the likely cause.
    assert "under the same spec, in a simulated world (seed 7); if `pdflow check" in out
    assert "this step is where the mutant core acted unlike the real one" in out
    rooms = "".join(f" --room {room}" for room in sorted(record_rooms(record)))
    assert rooms and set(input_rooms(record.input)) <= set(record_rooms(record))
    assert f"the timeline of what was recorded: pdflow trace show {edited}{rooms}\n" in out
    assert f"step by step up to here: pdflow replay {edited}{rooms}\n" in out
    # A node's trace (no seed) names no mutant.
    node = [msgspec.structs.replace(line, seed=None, clock="monotonic")
            if isinstance(line, TraceHeader) else line for line in lines]  # fmt: skip
    assert main(["replay", str(rewrite(tmp_path / "node.jsonl", node))]) == 1
    out = capsys.readouterr().out
    assert "what to do: this pdflow recorded it under the same spec, so the record" in out
    assert "mutant" not in out
    forced = [msgspec.structs.replace(line, spec_sha256="0" * 64)
              if isinstance(line, TraceHeader) else line for line in lines]  # fmt: skip
    assert main(["replay", "--force", str(rewrite(tmp_path / "forced.jsonl", forced))]) == 1
    assert "replayed with --force: where the spec changed" in capsys.readouterr().out


def test_a_divergence_at_a_timer_names_the_room_the_timer_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TimerFired input names no room: the pointer to the timeline had none either."""
    lines = lines_of(record_world(tmp_path / "world.jsonl"))
    index, record = next((i, line) for i, line in enumerate(lines)
                         if isinstance(line, StepRecord) and isinstance(line.input, TimerFired)
                         and line.fired)  # fmt: skip
    assert isinstance(record, StepRecord) and not input_rooms(record.input)
    [room] = {f.key for f in record.fired}
    lines[index] = msgspec.structs.replace(record, timer_at=12345.0)
    edited = rewrite(tmp_path / "edited.jsonl", lines)
    result = replay(load_traces([edited]))
    assert result.divergence is not None and result.divergence.rooms == (room,)
    assert main(["replay", str(edited)]) == 1
    assert f"pdflow trace show {edited} --room {room}\n" in capsys.readouterr().out
