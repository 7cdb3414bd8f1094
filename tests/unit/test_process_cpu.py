"""benchmarks/process_cpu: a process's CPU split into its main thread and the rest, from /proc;
and the side-by-side benchmark's CPU per room built from it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from benchmarks.process_cpu import CpuMeter, CpuSplit, cpu_used, thread_seconds
from benchmarks.sglang_side_by_side import cpu_per_room

# One thread spins on a CPU while the other sleeps, once a line comes on stdin; which one spins
# is the argument. The second thread lives on until stdin closes: the meter reads live threads.
_CHILD = textwrap.dedent("""
    import sys, threading, time
    spin_in_main = sys.argv[1] == "main"
    go, finished = threading.Event(), threading.Event()
    def work():  # until this thread has had 0.25 s of CPU, however loaded the machine
        end = time.thread_time() + 0.25
        while time.thread_time() < end:
            pass
    def other():
        go.wait()
        time.sleep(0.4) if spin_in_main else work()
        finished.set()
        sys.stdin.read()  # until the test ends
    threading.Thread(target=other, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    work() if spin_in_main else time.sleep(0.4)
    finished.wait()
    print("done", flush=True)
    sys.stdin.read()
""")


@contextmanager
def _child(spinner: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, spinner], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _measure(spinner: str) -> CpuSplit:
    with _child(spinner) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        meter = CpuMeter({"child": proc.pid})
        meter.start()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        return meter.stop()["child"]


@pytest.mark.parametrize("spinner", ["main", "thread"])
def test_a_spinning_thread_is_counted_where_it_runs(spinner: str) -> None:
    used = _measure(spinner)
    busy, idle = (used.main, used.others) if spinner == "main" else (used.others, used.main)
    # The spinner had 0.25 s of CPU by its own clock; the sleeper almost none.
    assert busy > 0.2, used
    assert idle < busy / 3, used
    assert used.total == pytest.approx(used.main + used.others)


def test_thread_seconds_reads_every_live_thread_of_a_process() -> None:
    with _child("main") as proc:
        times = thread_seconds(proc.pid)
    assert proc.pid in times  # the main thread's id is the process id
    assert all(seconds >= 0 for seconds in times.values())


def test_cpu_used_splits_the_main_thread_off_and_counts_new_threads_from_zero() -> None:
    before = {10: 1.0, 11: 2.0, 12: 5.0}  # 12 ends before the second reading
    after = {10: 1.5, 11: 2.25, 13: 0.125}  # 13 started in between
    assert cpu_used(10, before, after) == CpuSplit(main=0.5, others=0.375)


def test_stop_before_start_is_refused() -> None:
    with pytest.raises(RuntimeError, match="before start"):
        CpuMeter({"self": 1}).stop()


def test_cpu_per_room_sums_every_batch_before_dividing() -> None:
    batches = [
        {"rooms": 100, "seconds": 0.5, "cpu_s": {"prefill_main": 0.1, "decode_others": 0.3}},
        {"rooms": 300, "seconds": 1.5, "cpu_s": {"prefill_main": 0.1, "decode_others": 1.1}},
    ]
    cpu = cpu_per_room(batches)
    assert cpu["prefill_main"] == pytest.approx(0.5)  # 0.2 s over 400 rooms, in ms
    assert cpu["decode_others"] == pytest.approx(3.5)
    assert cpu["total"] == pytest.approx(4.0)
    assert cpu["cores_busy"] == pytest.approx(1.6 / 2.0)


def test_cpu_per_room_refuses_no_rooms() -> None:
    with pytest.raises(ValueError, match="at least one batch"):
        cpu_per_room([])


def test_schedstat_is_read_in_nanoseconds_and_stat_ticks_are_the_fallback(
    tmp_path: Path,
) -> None:
    from benchmarks import process_cpu

    with_schedstat = tmp_path / "1"
    with_schedstat.mkdir()
    (with_schedstat / "schedstat").write_text("2500000000 17 3\n")
    assert process_cpu._thread_seconds(with_schedstat) == pytest.approx(2.5)
    ticks_only = tmp_path / "2"
    ticks_only.mkdir()
    # pid (comm, which may hold spaces and parentheses) state, then fields 4..; utime and stime
    # are fields 14 and 15.
    fields = ["S"] + ["0"] * 10 + ["150", "50"] + ["0"] * 30
    (ticks_only / "stat").write_text("42 (a (b) c) " + " ".join(fields) + "\n")
    ticks = process_cpu._TICKS_PER_S
    assert process_cpu._thread_seconds(ticks_only) == pytest.approx(200 / ticks)
    with pytest.raises(FileNotFoundError):
        process_cpu._thread_seconds(tmp_path / "gone")
