"""Traces of two processes merge into one causal order: per-endpoint seq and message ids."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pdflow.core.endpoints.endpoint_io import Received
from pdflow.trace.format import StepRecord, TraceHeader, parse_message_id
from pdflow.trace.merge import TraceMergeError, load_traces
from pdflow.trace.recorder import TraceRecorder
from pdflow.trace.replay import replay
from pdflow.trace.synthetic import DECODE_ID, PREFILL_ID, SyntheticWorld
from tests.unit.trace_fixtures import SCRIPTS, lines_of, record_world, rewrite


def _two_process_run(tmp_path: Path) -> tuple[Path, Path]:
    prefill_file, decode_file = tmp_path / "prefill.jsonl", tmp_path / "decode.jsonl"
    with (
        TraceRecorder(prefill_file, clock="virtual") as prefill,
        TraceRecorder(decode_file, clock="virtual") as decode,
    ):
        SyntheticWorld({PREFILL_ID: prefill, DECODE_ID: decode}, SCRIPTS, seed=7).run()
    return prefill_file, decode_file


def _assert_causal(records: list[StepRecord]) -> None:
    position = {(r.endpoint, r.seq): i for i, r in enumerate(records)}
    last_seq: dict[str, int] = {}
    for i, record in enumerate(records):
        assert record.seq == last_seq.get(record.endpoint, -1) + 1
        last_seq[record.endpoint] = record.seq
        if isinstance(record.input, Received) and record.input.msg_id:
            sender, seq, _ = parse_message_id(record.input.msg_id)
            assert position[(sender, seq)] < i


def test_files_of_two_processes_merge_and_replay(tmp_path: Path) -> None:
    prefill_file, decode_file = _two_process_run(tmp_path)
    single = load_traces([record_world(tmp_path / "world.jsonl")])
    merged = load_traces([decode_file, prefill_file])
    assert list(merged.headers) == ["decode-0", "prefill-0"]
    _assert_causal(merged.records)
    key = lambda r: (r.endpoint, r.seq)  # noqa: E731
    assert sorted(merged.records, key=key) == sorted(single.records, key=key)
    assert replay(merged).ok


def test_merge_follows_message_ids_when_clocks_disagree(tmp_path: Path) -> None:
    prefill_file, decode_file = _two_process_run(tmp_path)
    # Another host's monotonic clock: the decode's times are 1000 s "earlier" than the prefill's.
    skewed = [
        msgspec.structs.replace(line, t=line.t - 1000.0) if isinstance(line, StepRecord) else line
        for line in lines_of(decode_file)
    ]
    merged = load_traces([prefill_file, rewrite(tmp_path / "skewed.jsonl", skewed)])
    _assert_causal(merged.records)
    # With only the clock to go by, decode records would come before the messages they got.
    naive = sorted(merged.records, key=lambda r: r.t)
    with pytest.raises(AssertionError):
        _assert_causal(naive)


def test_the_same_file_twice_is_harmless_but_conflicts_are_not(tmp_path: Path) -> None:
    path = record_world(tmp_path / "world.jsonl")
    assert len(load_traces([path, path]).records) == len(load_traces([path]).records)
    lines = lines_of(path)
    changed = [
        msgspec.structs.replace(line, t=line.t + 1.0)
        if isinstance(line, StepRecord) and line.seq == 3 and line.endpoint == PREFILL_ID
        else line
        for line in lines
    ]
    with pytest.raises(TraceMergeError, match="seq 3 appears twice"):
        load_traces([path, rewrite(tmp_path / "other.jsonl", changed)])
    other_config = [
        msgspec.structs.replace(line, seed=99) if isinstance(line, TraceHeader) else line
        for line in lines
    ]
    with pytest.raises(TraceMergeError, match="two different endpoints"):
        load_traces([path, rewrite(tmp_path / "other2.jsonl", other_config)])


def test_an_empty_file_among_good_ones_is_refused(tmp_path: Path) -> None:
    """A node whose file is empty must not vanish from the incident behind a clean replay."""
    prefill_file, decode_file = _two_process_run(tmp_path)
    decode_file.write_bytes(b"")
    with pytest.raises(TraceMergeError, match=f"{decode_file}: no pdflow trace header"):
        load_traces([prefill_file, decode_file])


def _received_from(lines: list[TraceHeader | StepRecord], sender: str) -> int:
    return next(
        i for i, line in enumerate(lines)
        if isinstance(line, StepRecord) and isinstance(line.input, Received)
        and line.input.msg_id is not None and line.input.msg_id.startswith(f"{sender}:")
    )  # fmt: skip


def test_a_received_message_must_be_what_its_sender_recorded(tmp_path: Path) -> None:
    prefill_file, decode_file = _two_process_run(tmp_path)
    lines = lines_of(decode_file)
    index = _received_from(lines, PREFILL_ID)
    record = lines[index]
    assert isinstance(record, StepRecord) and isinstance(record.input, Received)
    edited = msgspec.structs.replace(
        record.input, message=msgspec.structs.replace(record.input.message, generation=99)
    )
    lines[index] = msgspec.structs.replace(record, input=edited)
    with pytest.raises(
        TraceMergeError,
        match=f"endpoint decode-0 seq {record.seq} received message {record.input.msg_id} but "
        f"prefill-0 seq .* sent another message",
    ):
        load_traces([prefill_file, rewrite(tmp_path / "edited.jsonl", lines)])
    # The ids point into the sender's records by seq: renumbered records no longer match.
    sender, seq, _ = parse_message_id(record.input.msg_id or "")
    renumbered = [
        msgspec.structs.replace(line, seq=line.seq + 1 if line.seq == seq - 1 else seq - 1)
        if isinstance(line, StepRecord) and line.seq in (seq - 1, seq) else line
        for line in lines_of(prefill_file)
    ]  # fmt: skip
    with pytest.raises(TraceMergeError, match=f"but {sender} seq {seq} "):
        load_traces([rewrite(tmp_path / "renumbered.jsonl", renumbered), decode_file])


def test_messages_whose_sender_is_not_here_are_counted_by_sender(tmp_path: Path) -> None:
    prefill_file, decode_file = _two_process_run(tmp_path)
    both = load_traces([prefill_file, decode_file])
    assert not both.absent_senders and not both.cut_short
    alone = load_traces([decode_file])
    receipts = sum(
        1 for r in alone.records if isinstance(r.input, Received) and r.input.msg_id is not None
    )
    assert alone.absent_senders == {PREFILL_ID: receipts} and receipts > 0
    lines = lines_of(prefill_file)
    last_sender = max(
        parse_message_id(line.input.msg_id or "")[1]
        for line in lines_of(decode_file)
        if isinstance(line, StepRecord) and isinstance(line.input, Received)
    )
    cut = [line for line in lines if not isinstance(line, StepRecord) or line.seq < 10]
    short = load_traces([rewrite(tmp_path / "cut.jsonl", cut), decode_file])
    assert short.cut_short == {PREFILL_ID: (9, last_sender)}
    assert not short.absent_senders
