"""CPU time a process's threads used over a stretch of wall time, read from ``/proc``.

Side by side on a 2-core machine both systems can be CPU-bound, and then rooms/s follows the
CPU each room costs, wherever in the two processes it is spent. This reads every thread's time
on a CPU (``/proc/<pid>/task/<tid>/schedstat``, nanoseconds; the ``stat`` file's clock ticks
where schedstat is absent) and splits it into the process's main thread and the rest. In a
``tests_sglang/driver.py`` process the main thread is the scheduler's: the stand-in scheduler
and every call it makes into the backend. The rest are the backend's own threads (pdflow's
event loop, SGLang's transfer threads) and the engine's C++ threads.

A thread that ends between the two readings loses what it used after the first one; a thread
that starts in between counts from zero.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _thread_seconds(task: Path) -> float:
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except FileNotFoundError:
        if not task.exists():
            raise
    # No schedstat (a kernel without CONFIG_SCHEDSTATS): utime + stime, in clock ticks.
    stat = (task / "stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def thread_seconds(pid: int) -> dict[int, float]:
    """Seconds on a CPU so far of each live thread of ``pid``, by thread id."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = _thread_seconds(task)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we read the others
    return times


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds of one process: its main thread and all its other threads."""

    main: float
    others: float

    @property
    def total(self) -> float:
        return self.main + self.others


def cpu_used(pid: int, before: dict[int, float], after: dict[int, float]) -> CpuSplit:
    """What ``pid``'s threads used between two ``thread_seconds`` readings."""
    used = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    main = used.pop(pid, 0.0)
    return CpuSplit(main=main, others=sum(used.values()))


class CpuMeter:
    """CPU of a few named processes between ``start()`` and ``stop()``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._before: dict[str, dict[int, float]] = {}

    def start(self) -> None:
        self._before = {name: thread_seconds(pid) for name, pid in self._pids.items()}

    def stop(self) -> dict[str, CpuSplit]:
        if not self._before:
            raise RuntimeError("CpuMeter.stop() before start()")
        return {
            name: cpu_used(pid, self._before[name], thread_seconds(pid))
            for name, pid in self._pids.items()
        }
