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
