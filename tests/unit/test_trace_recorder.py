"""The recorder: structlog chain, errors recorded and re-raised, rotation, and off means off."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdflow.core.endpoints.endpoint_io import ClearRoom, OpenRoom, PrefillEndpointConfig, TimerFired
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.protocol.messages import PeerId
from pdflow.spec import spec_sha256
from pdflow.trace.format import StepRecord, TraceHeader, decode_line, read_trace
from pdflow.trace.merge import load_traces
from pdflow.trace.recorder import MAX_PENDING, RecordingEndpoint, TraceRecorder
from pdflow.trace.replay import ReplayRefused, replay
from pdflow.trace.synthetic import SyntheticWorld, choose_scripts
from tests.unit.trace_fixtures import SCRIPTS, record_world

CONFIG = PrefillEndpointConfig(me=PeerId("127.0.0.1:17000", "life-1", 0))


def test_a_refused_input_is_recorded_as_error_and_re_raised(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceRecorder(path, clock="virtual") as recorder:
        endpoint = recorder.wrap("p", PrefillEndpoint(CONFIG))
        assert isinstance(endpoint, RecordingEndpoint)
        endpoint.handle(OpenRoom(5, 1), 1.0)
        with pytest.raises(LocalProtocolError, match="only a terminal room"):
            endpoint.handle(ClearRoom(5), 2.0)
        assert endpoint.last_seq == 1
        endpoint.handle(TimerFired(), 400.0)
    header, *records = list(read_trace(path))
    assert isinstance(header, TraceHeader)
    assert (header.spec_sha256, header.clock, header.role) == (spec_sha256(), "virtual", "prefill")
    assert [r.seq for r in records if isinstance(r, StepRecord)] == [0, 1, 2]
    refused = records[1]
    assert isinstance(refused, StepRecord) and refused.error is not None
    assert refused.error.kind == "LocalProtocolError"
    assert refused.outputs == [] and refused.timer_at == 301.0
    assert refused.rooms[0]["summary"]["state"] == "BOOTSTRAPPING"  # type: ignore[index]
    assert replay(load_traces([path])).ok


def test_virtual_clock_needs_a_time_and_endpoints_need_a_header(tmp_path: Path) -> None:
    with TraceRecorder(tmp_path / "t.jsonl", clock="virtual") as recorder:
        endpoint = PrefillEndpoint(CONFIG)
        step = endpoint.handle(OpenRoom(1, 1), 0.0)
        with pytest.raises(ValueError, match="add_endpoint first"):
            recorder.record("p", 0.0, OpenRoom(1, 1), step, [])
        recorder.add_endpoint("p", "prefill", CONFIG)
        with pytest.raises(ValueError, match="pass t=now"):
            recorder.record("p", None, OpenRoom(1, 1), step, [])
        with pytest.raises(ValueError, match="already in this trace"):
            recorder.add_endpoint("p", "prefill", CONFIG)
        with pytest.raises(ValueError, match="role 'decode' but a prefill config"):
            recorder.add_endpoint("q", "decode", CONFIG)
    with pytest.raises(ValueError, match="clock must be one of"):
        TraceRecorder(None, clock="wall")


def test_monotonic_clock_stamps_the_time_when_none_is_given() -> None:
    recorder = TraceRecorder(None, clock="monotonic")
    recorder.add_endpoint("p", "prefill", CONFIG)
    endpoint = PrefillEndpoint(CONFIG)
    before = time.monotonic()
    recorder.record("p", None, OpenRoom(1, 1), endpoint.handle(OpenRoom(1, 1), 0.0), [])
    header, record = [decode_line(line) for line in recorder.lines]
    assert isinstance(header, TraceHeader) and isinstance(record, StepRecord)
    assert before <= record.t <= time.monotonic()


def test_rotation_bounds_the_files_and_keeps_headers(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    with TraceRecorder(path, clock="virtual", max_bytes=40_000, backups=2) as recorder:
        SyntheticWorld(recorder, SCRIPTS * 3, seed=7).run()
        assert recorder.rotations >= 3
    files = [path, path.with_name("node.jsonl.1"), path.with_name("node.jsonl.2")]
    assert all(f.is_file() for f in files) and not path.with_name("node.jsonl.3").exists()
    for f in files:
        assert f.stat().st_size <= 40_000
        lines = list(read_trace(f))
        assert [type(x).__name__ for x in lines[:2]] == ["TraceHeader", "TraceHeader"]
    # The oldest records were rotated away: replay says so instead of diverging.
    with pytest.raises(ReplayRefused, match="rotated"):
        replay(load_traces(list(reversed(files))))


def test_rotated_files_together_replay_when_nothing_was_dropped(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    with TraceRecorder(path, clock="virtual", max_bytes=40_000, backups=50) as recorder:
        SyntheticWorld(recorder, SCRIPTS * 3, seed=7).run()
        rotations = recorder.rotations
    files = [path.with_name(f"node.jsonl.{i}") for i in range(rotations, 0, -1)] + [path]
    assert replay(load_traces(files)).ok


def test_off_means_no_file_no_wrapper_and_the_same_behaviour(tmp_path: Path) -> None:
    path = tmp_path / "off.jsonl"
    recorder = TraceRecorder(path, enabled=False)
    bare = PrefillEndpoint(CONFIG)
    assert recorder.wrap("p", bare) is bare
    assert recorder.record("p", 0.0, OpenRoom(1, 1), bare.handle(OpenRoom(1, 1), 0.0), []) is None
    recorder.close()
    assert not path.exists()
    off_world = SyntheticWorld(recorder, SCRIPTS, seed=7)
    off_stats = off_world.run()
    on_path = record_world(tmp_path / "on.jsonl")
    on_steps = sum(1 for line in read_trace(on_path) if isinstance(line, StepRecord))
    assert off_stats.steps == on_steps and not path.exists()


def test_recording_cost_per_step_is_small(tmp_path: Path) -> None:
    # Informative bound only (CI machines vary): the chain must not cost milliseconds.
    scripts = choose_scripts(200, seed=1)
    started = time.perf_counter()
    stats = SyntheticWorld(TraceRecorder(None, enabled=False), scripts, seed=1).run()
    off = time.perf_counter() - started
    with TraceRecorder(tmp_path / "cost.jsonl", clock="virtual") as recorder:
        started = time.perf_counter()
        SyntheticWorld(recorder, scripts, seed=1).run()
        on = time.perf_counter() - started
    per_step_us = (on - off) / stats.steps * 1e6
    assert per_step_us < 1000, f"recording costs {per_step_us:.0f} us per step"


def test_deferred_recording_writes_the_same_steps_in_the_same_order(tmp_path: Path) -> None:
    # The deferral here never runs: the records are written only by the recorder's own
    # triggers (a batch of MAX_PENDING, a refused input, a new endpoint's header, close).
    deferrals: list[object] = []
    now = record_world(tmp_path / "now.jsonl", SCRIPTS * 6)
    later = record_world(tmp_path / "later.jsonl", SCRIPTS * 6, defer=deferrals.append)
    assert deferrals, "the recorder never deferred a write"
    steps_now = [line for line in now.read_bytes().splitlines() if b'"kind":"step"' in line]
    steps_later = [line for line in later.read_bytes().splitlines() if b'"kind":"step"' in line]
    assert len(steps_now) > 2 * MAX_PENDING
    assert steps_later == steps_now
    assert replay(load_traces([later])).ok


def test_a_deferred_step_is_written_when_the_deferral_runs(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    deferrals: list[Callable[[], None]] = []
    recorder = TraceRecorder(path, clock="virtual", defer=deferrals.append)
    endpoint = recorder.wrap("p", PrefillEndpoint(CONFIG))
    endpoint.handle(OpenRoom(5, 1), 1.0)
    endpoint.handle(TimerFired(), 2.0)
    assert deferrals == [recorder.write_pending]  # once per batch, not per step
    deferrals[0]()
    recorder._sink.flush()  # type: ignore[union-attr]
    assert [r.seq for r in read_trace(path) if isinstance(r, StepRecord)] == [0, 1]
    recorder.close()


def test_a_refused_input_writes_the_deferred_steps_before_it_at_once(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recorder = TraceRecorder(path, clock="virtual", defer=lambda write: None)
    endpoint = recorder.wrap("p", PrefillEndpoint(CONFIG))
    endpoint.handle(OpenRoom(5, 1), 1.0)
    with pytest.raises(LocalProtocolError):
        endpoint.handle(ClearRoom(5), 2.0)
    records = [r for r in read_trace(path) if isinstance(r, StepRecord)]  # before close
    assert [(r.seq, r.error is not None) for r in records] == [(0, False), (1, True)]
    recorder.close()


def test_deferred_records_are_written_at_a_bound_and_before_a_later_header(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recorder = TraceRecorder(path, clock="virtual", defer=lambda write: None)
    first = recorder.wrap("p", PrefillEndpoint(CONFIG))
    first.handle(OpenRoom(5, 1), 1.0)
    second = recorder.wrap("q", PrefillEndpoint(CONFIG))  # its header follows p's step
    for tick in range(MAX_PENDING):
        second.handle(TimerFired(), 2.0 + tick)
    recorder._sink.flush()  # type: ignore[union-attr]
    kinds = [(type(line).__name__, line.endpoint) for line in read_trace(path)]
    assert kinds[:3] == [("TraceHeader", "p"), ("StepRecord", "p"), ("TraceHeader", "q")]
    assert len(kinds) == 3 + MAX_PENDING, "a full batch was kept instead of written"
    recorder.close()
