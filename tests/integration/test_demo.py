"""The main job, short: a real prefill (TP=2) and decode (TP=1) on loopback, tokens equal to a
single-process run, no page quarantined or leaked; with faults, every request still recovers
(over Mooncake the stopped prefill's pages stay quarantined: nothing can fence it), and the
traces show each fault landing inside a write; its traces replay identically and pass the spec
monitor. Then what the command promises around that: JSON on stdout alone, one-line errors with
exit 2 for bad input, exit 130 on Ctrl-C, trace commands that run when pasted."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from rich.console import Console

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.demo.cli_view import _show_failure, trace_room
from pdflow.demo.engines import RoomOutcome
from pdflow.demo.instances import (
    STOPPED,
    PendingResult,
    PrefillInstance,
    TransportFactory,
    decode_instance,
)
from pdflow.demo.kvcache import PagedKVCache
from pdflow.demo.link import PrefillLink
from pdflow.demo.model import ModelConfig, TinyTransformer
from pdflow.demo.run import (
    MAX_ATTEMPTS,
    DemoOptions,
    DemoReport,
    RequestRecord,
    Router,
    demo_settings,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CLI = [sys.executable, "-m", "pdflow.cli"]
STATE_BYTES = ModelConfig().d_model * 4  # one float32 memory vector per request


def run_demo(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "demo"
    done = subprocess.run(
        [*CLI, "demo", "--json", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)  # stdout is the report and nothing else
    return report


def check_traces(report: dict[str, Any]) -> None:
    traces = report["traces"]
    assert isinstance(traces, list) and traces
    for command in (["replay"], ["trace", "check"]):
        done = subprocess.run([*CLI, *command, *traces],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr


def steps(path: str) -> Iterator[dict[str, Any]]:
    with open(path) as trace:
        for line in trace:
            record = json.loads(line)
            if record["kind"] == "step":
                yield record


def writes(paths: list[str], room: int, generation: int,
           ) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float]]:  # fmt: skip
    """(endpoint, chunk seq) -> time, of the room attempt's writes started (start_transfer
    outputs) and completed (TransferCompleted inputs), over these prefill traces."""
    started: dict[tuple[str, int], float] = {}
    completed: dict[tuple[str, int], float] = {}
    for path in paths:
        for step in steps(path):
            for out in step["outputs"]:
                if out["type"] == "start_transfer" and (out["room"], out["generation"]) == (
                    room,
                    generation,
                ):
                    started[(step["endpoint"], out["seq"])] = step["t"]
            inp = step["input"]
            if inp["type"] == "TransferCompleted" and (inp["room"], inp["generation"]) == (
                room,
                generation,
            ):
                completed[(step["endpoint"], inp["seq"])] = step["t"]
    return started, completed


def decode_abort_time(path: str, room: int, generation: int) -> float:
    """When the decode's engine aborted this room attempt (the demo's fault)."""
    open_generation: dict[int, int] = {}
    for step in steps(path):
        inp = step["input"]
        if inp["type"] == "OpenReceiver":
            open_generation[inp["room"]] = inp["generation"]
        elif (inp["type"] == "RoomCall" and inp["call"]["type"] == "AbortRequested"
              and inp["room"] == room and open_generation.get(room) == generation
              and "demo fault" in inp["call"]["reason"]):  # fmt: skip
            return float(step["t"])
    raise AssertionError(f"no demo abort of room {room} generation {generation} in {path}")


@pytest.mark.parametrize("transport", ["mooncake", "inprocess"])
def test_demo_tokens_equal_and_nothing_leaks(tmp_path: Path, transport: str) -> None:
    report = run_demo(tmp_path, "--requests", "4", "--max-new", "6", "--transport", transport)
    assert report["transport"] == transport
    assert report["tokens_equal"] is True and report["succeeded"] == 4
    assert report["pages_quarantined"] == 0 and report["pages_leaked"] == 0
    # --max-new counts every generated token, the prefill's first one included.
    assert report["tokens_generated"] == 4 * 6
    assert all(len(r["tokens"]) == 6 for r in report["records"])
    # The bytes are KV pages plus one model-state vector per request, counted apart.
    assert report["bytes_moved"] == report["kv_bytes"] + report["state_bytes"]
    assert report["state_bytes"] == 4 * STATE_BYTES and report["kv_bytes"] > 0
    assert report["transfer_gbps"] > 0 and report["transport_busy_s"] > 0
    check_traces(report)


def test_demo_recovers_from_aborts_and_a_prefill_stop(tmp_path: Path) -> None:
    report = run_demo(tmp_path, "--requests", "8", "--max-new", "4", "--faults")
    assert report["tokens_equal"] is True and report["succeeded"] == 8
    assert isinstance(report["attempts"], int) and report["attempts"] > 8
    faults = report["faults"]
    assert any("stopped abruptly" in f for f in faults)
    assert any("restarted as incarnation" in f for f in faults)
    # Over Mooncake TCP (no receiver-side fence) the stopped prefill's pages stay held; every
    # quarantined page must be one of those, and none may leak.
    assert report["pages_leaked"] == 0
    assert report["pages_quarantined"] == report["pages_held_for_dead_writers"]
    if report["transport"] != "mooncake":
        assert report["pages_quarantined"] == 0
    traces = report["traces"]
    prefills = [p for p in traces if Path(p).name.startswith("prefill-")]
    decode = next(p for p in traces if Path(p).name.startswith("decode-"))

    # The prefill was stopped inside a write: its trace has a write of the faulted room that
    # started and never completed, half of whose bytes had landed.
    (stop,) = [f for f in report["injected"] if f["kind"] == "prefill_stop"]
    killed = [p for p in prefills if Path(p).name == f"prefill-{stop['incarnation']}.jsonl"]
    started, completed = writes(killed, stop["room"], stop["generation"])
    assert set(started) - set(completed), (started, completed)
    assert stop["landed_bytes"] > 0 and stop["held_bytes"] > 0

    # The decode aborted while a write of the room was in flight: started before the abort,
    # completed after it.
    aborts = [f for f in report["injected"] if f["kind"] == "decode_abort"]
    assert aborts
    for abort in aborts:
        aborted_at = decode_abort_time(decode, abort["room"], abort["generation"])
        started, completed = writes(prefills, abort["room"], abort["generation"])
        assert any(t < aborted_at < completed.get(key, float("inf"))
                   for key, t in started.items()), (aborted_at, started, completed)  # fmt: skip
    check_traces(report)


def test_demo_runs_more_requests_in_flight_than_it_used_to_have_rows(tmp_path: Path) -> None:
    """Aux rows and state slots come from --concurrency (they were 64: a crash past it, and a
    30 s stall where a prefill failure was not passed on to the decode)."""
    report = run_demo(tmp_path, "--requests", "70", "--concurrency", "70", "--max-new", "2",
                      "--transport", "inprocess")  # fmt: skip
    assert report["succeeded"] == 70 and report["tokens_equal"] is True
    assert report["attempts"] == 70, [r["failures"] for r in report["records"] if r["failures"]]
    assert report["wall_s"] < 25


def fake_mooncake(tmp_path: Path) -> dict[str, str]:
    """An environment where `import mooncake.engine` fails, as where it is not installed."""
    package = tmp_path / "shadow" / "mooncake"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('no mooncake here')\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--out", "{file}/x"], "--out"),
        (["--out", "/proc/pdflow-demo"], "--out"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**64)], "--seed"),
        (["--requests", "1000000000"], "--requests"),
        (["--prompt-len", "1000000000"], "--prompt-len"),
        (["--concurrency", "10000000"], "--concurrency"),
        (["--concurrency", "256", "--prompt-len", "2048"], "GiB"),
        (["--transport", "mooncake"], "--transport mooncake"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = [arg.replace("{file}", str(a_file)) for arg in args]
    env = fake_mooncake(tmp_path) if "mooncake" in args else None
    defaults = {"--requests": "1", "--out": str(tmp_path / "out")}
    for flag, value in defaults.items():
        if flag not in args:
            args += [flag, value]
    done = subprocess.run([*CLI, "demo", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_stops_with_130_and_points_at_the_partial_traces(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    demo = subprocess.Popen([*CLI, "demo", "--out", str(out), "--requests", "600", "--max-new", "2",
                             "--transport", "inprocess"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not any((out / "traces").glob("decode-*.jsonl")):  # requests are under way
            assert demo.poll() is None and time.monotonic() < deadline, demo.communicate()
            time.sleep(0.2)
        time.sleep(0.5)
        demo.send_signal(signal.SIGINT)
        stdout, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert f"interrupted; partial traces in {out / 'traces'}" in stderr
    assert "Traceback" not in stderr + stdout and "crashed" not in stderr + stdout


def test_printed_trace_commands_run_when_pasted(tmp_path: Path) -> None:
    """No `pdflow` on PATH, a space in --out: the printed commands still run, and the
    timeline is for a room that failed an attempt."""
    out = tmp_path / "demo out"
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*CLI, "demo", "--out", str(out), "--requests", "8", "--max-new", "2",
                           "--faults", "--transport", "inprocess"],
                          env=env, capture_output=True, text=True, timeout=200,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    commands = {}
    for line in done.stdout.splitlines():
        label, _, command = line.strip().partition(":")
        if label in ("replay", "timeline"):
            commands[label] = shlex.split(command)
    assert set(commands) == {"replay", "timeline"}, done.stdout
    room = commands["timeline"][commands["timeline"].index("--room") + 1]
    assert f"room {room} generation" in " ".join(done.stdout.split()), done.stdout
    for argv in commands.values():
        pasted = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                                check=False)  # fmt: skip
        assert pasted.returncode == 0, (argv, pasted.stdout[-2000:], pasted.stderr[-2000:])
    assert f"room {room}" in pasted.stdout


def test_write_rate_is_over_the_union_of_write_intervals() -> None:
    link = PrefillLink()
    link.writes += [(0.0, 2.0, 100), (1.0, 3.0, 100), (2.5, 2.75, 100), (5.0, 6.0, 100)]
    assert link.busy_seconds() == 4.0  # [0, 3] and [5, 6]; the durations sum to 5.25
    assert link.bytes_written() == 400


def _report(records: list[RequestRecord]) -> DemoReport:
    return DemoReport(
        transport="inprocess", requests=len(records), succeeded=0, tokens_equal=False,
        attempts=0, tokens_generated=0, bytes_moved=0, kv_bytes=0, state_bytes=0,
        transfer_gbps=None, transport_busy_s=0.0, handshake_ms_p50=None,
        handshake_ms_p99=None, ttft_ms_p50=None, ttft_ms_p99=None, pages_quarantined=0,
        pages_held_for_dead_writers=0, pages_leaked=0, faults=[], injected=[], traces=[],
        wall_s=0.0, records=records,
    )  # fmt: skip


def test_failure_summary_says_which_failure() -> None:
    failed = RequestRecord(0, 791_700, attempts=5, failures=["generation 4: decode timed out"])
    report = _report([failed, RequestRecord(1, 791_701, ok=True, tokens=[1], expected=[1])])
    shown = io.StringIO()
    _show_failure(Console(file=shown, width=200), report, 0)
    assert "1 request failed every attempt" in shown.getvalue()
    assert "differ" not in shown.getvalue()
    assert trace_room(report) == 791_700


class _FakePrefill:
    """Stands in for a prefill instance: ``outcome`` says how every room of it ends."""

    def __init__(self, outcome: RoomOutcome, transferred: RoomOutcome | None,
                 bootstrap: str = "127.0.0.1:1") -> None:  # fmt: skip
        self.outcome = outcome
        self.transferred = transferred
        self.bootstrap = bootstrap
        self.ready = anyio.Event()
        self.ready.set()

    def submit(self, room: int, generation: int, prompt: list[int]) -> PendingResult:
        result = PendingResult()
        result.transferred = self.transferred
        result.set(self.outcome)
        return result

    async def abort(self, room: int, reason: str) -> None:
        pass


class _VerifiedDecode:
    """A decode whose every room ends in a checksum-verified Success."""

    async def serve(self, room: int, generation: int, bootstrap: str, prompt_len: int,
                    max_new: int, abort_when: object = None) -> RoomOutcome:  # fmt: skip
        return RoomOutcome(KVPoll.Success, tokens=[7] * max_new, ttft_s=0.01, handshake_s=0.01)

    async def fail(self, room: int, generation: int, reason: str) -> None:
        raise AssertionError("a stopped prefill reports nothing to pass on")


def test_verified_success_stands_when_the_prefill_stops_while_clearing() -> None:
    async def main() -> RequestRecord:
        done = RoomOutcome(KVPoll.Success, bytes_written=24_832, transfer_s=0.001)
        router = Router(DemoOptions(requests=1), _VerifiedDecode(), lambda: None, PrefillLink(),
                        lambda _: None)  # fmt: skip
        router.prefill = _FakePrefill(STOPPED, transferred=done)
        record = RequestRecord(0, 791_700)
        await router.run_request(record, [1, 2, 3])
        return record

    record = anyio.run(main, backend="asyncio")
    assert record.ok and record.attempts == 1, record.failures
    assert record.bytes_moved == 24_832


def test_a_prefill_failure_aborts_the_decode_room_at_once(tmp_path: Path) -> None:
    """A live prefill that fails a room: the decode's room is aborted then, not after its
    30 s timers. A real decode, against a real prefill's registry."""

    async def main() -> tuple[RequestRecord, float]:
        settings = demo_settings(tmp_path)
        model = TinyTransformer(ModelConfig())
        geometry = model.config.kv_geometry()
        prefill_caches = [PagedKVCache(geometry, 32, tp_rank=r, tp_size=2) for r in range(2)]
        decode_cache = PagedKVCache(geometry, 32)
        page_bytes = decode_cache.bytes_per_page * 2 * geometry.n_layers
        transports, link = TransportFactory("inprocess"), PrefillLink()
        async with (
            decode_instance(model, decode_cache, settings, transports,
                            staging_bytes=page_bytes * 32, rows=1) as decode,
            anyio.create_task_group() as tasks,
        ):  # fmt: skip
            prefill = PrefillInstance(model, prefill_caches, settings, transports,
                                      f"{settings.host}:0", staging_slot_bytes=page_bytes * 4,
                                      link=link, rows=1)  # fmt: skip
            tasks.start_soon(prefill.run)
            await prefill.ready.wait()
            failing = _FakePrefill(RoomOutcome(KVPoll.Failed, "prefill engine error: injected"),
                                   None, prefill.bootstrap)  # fmt: skip
            router = Router(DemoOptions(requests=1), decode, lambda: prefill, link,
                            lambda _: None)  # fmt: skip
            router.prefill = failing
            record = RequestRecord(0, 791_700)
            started = time.perf_counter()
            with anyio.fail_after(20):
                await router.run_request(record, list(range(20)))
            elapsed = time.perf_counter() - started
            tasks.cancel_scope.cancel()
        return record, elapsed

    record, elapsed = anyio.run(main, backend="asyncio")
    assert not record.ok and record.attempts == MAX_ATTEMPTS
    assert all("the prefill failed" in f for f in record.failures), record.failures
    assert elapsed < 10
