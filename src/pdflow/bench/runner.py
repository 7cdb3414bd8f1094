"""Run the benchmark suites side by side and judge each ratio against pdflow's targets.

The suites live in the repository's ``benchmarks/`` package (scripts, not part of the installed
library), imported lazily so a missing one is reported as "not available" instead of breaking
the others. Targets and anchors are those of the performance-targets reference (2-core CPU VM,
loopback, Mooncake TCP); every figure is a ratio to a baseline measured in the same run, except
where no side-by-side baseline can exist here (SGLang's control plane: its measured anchor).

Contracts of the suites written elsewhere (the runner passes only the keyword arguments their
``run`` declares):

* ``benchmarks/control_plane.py``: ``run(rooms=N, progress=...) -> dict`` with
  ``rooms_per_s``, ``handshake_p50_ms`` and ``handshake_p99_ms``; called once per concurrency;
* ``benchmarks/pdflow_vs_raw.py`` (optional): ``run(size=BYTES, repeats=N, progress=...)
  -> dict`` with ``bytes``, ``pdflow_gbps``, ``raw_mooncake_gbps`` and ``pdflow_vs_raw``;
  called once per size. Without it the data-plane target is judged on the transport layer
  alone (``transport_raw``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

Progress = Callable[[str], None]

MIB = 1 << 20
SUITES = ("control", "sglang", "scale", "data", "hetero", "core")

# Anchors and targets, from the performance-targets reference.
SGLANG_ROOMS_PER_S = 393.0  # 256 concurrent 4 KiB rooms, median of 3
SGLANG_P99_MS = 643.0  # create -> Success, same load
CONTROL_CONCURRENCY = 256
CONTROL_LOADS = (16, 64, 256, 512)
CONTROL_QUICK_LOADS = (16, 64)
CONTROL_KEYS = ("rooms_per_s", "handshake_p50_ms", "handshake_p99_ms")
CONTROL_RATIO_TARGET = 2.0
SGLANG_SHAPES = ("256x4K", "64x1M", "4x64M")
SGLANG_QUICK_SHAPES = ("256x4K",)
SGLANG_LOADS_4K = (16, 64, 256)
SGLANG_BIG_SHAPES_TARGET = 1.0  # 64 x 1 MiB and 4 x 64 MiB: at least SGLang's rooms/s
SCALE_LOADS = (1000, 4000, 16000)
SCALE_QUICK_LOADS = (100, 400)
SCALE_REPEATS = 3
SCALE_FLATNESS_TARGET = 0.8  # slowest load's rooms/s over the fastest's: flat within 20%
DATA_SIZE = 64 * MIB
DATA_SIZES_MIB = (1, 4, 16, 64, 256)
DATA_QUICK_SIZES_MIB = (1, 4, 16)
END_TO_END_KEYS = ("bytes", "pdflow_gbps", "raw_mooncake_gbps", "pdflow_vs_raw")
DATA_RATIO_TARGET = 0.9
HETERO_RATIO_TARGET = 10.0
# (MiB, ops) as pdflow_vs_raw's plan writes those rooms: one op per K or V buffer of a layer.
NOTIFY_FLOOR_SHAPES = ((1, 4), (4, 4))
NOTIFY_FLOOR_QUICK = ((1, 4),)
NOTIFY_FLOOR_ROUNDS = 300
NOTIFY_FLOOR_QUICK_ROUNDS = 30
CORE_STEPS_TARGET = 100_000.0
CORE_BYTES_PER_ROOM_TARGET = 2048.0


class SuiteUnavailable(Exception):
    """The suite's benchmark module is not there (yet); nothing was measured."""


@dataclass(frozen=True)
class Check:
    """One judged figure. ``target`` None means reported for context, not judged."""

    suite: str
    measure: str
    value: float
    unit: str
    target: float | None
    higher_is_better: bool = True
    baseline: str = ""

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        met = self.value >= self.target if self.higher_is_better else self.value <= self.target
        return "pass" if met else "miss"


@dataclass
class SuiteResult:
    name: str
    status: str  # "ok", "not available" or "error"
    detail: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)


@dataclass
class BenchReport:
    quick: bool
    started: str
    machine: dict[str, Any]
    suites: list[SuiteResult] = field(default_factory=list)

    @property
    def checks(self) -> list[Check]:
        return [check for suite in self.suites for check in suite.checks]

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": {"quick": self.quick, "started": self.started, "machine": self.machine},
            "suites": {
                suite.name: {
                    "status": suite.status,
                    "detail": suite.detail,
                    "seconds": suite.seconds,
                    "data": suite.data,
                }
                for suite in self.suites
            },
            "checks": [asdict(check) | {"verdict": check.verdict} for check in self.checks],
        }


# ---- loading the benchmarks package --------------------------------------------------------------
def _benchmark_roots() -> list[Path]:
    """Where a ``benchmarks/`` package may sit: the working directory, then this checkout."""
    return [Path.cwd(), Path(__file__).resolve().parents[3]]


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks.<name>``; raise SuiteUnavailable when that file does not exist."""
    if importlib.util.find_spec("benchmarks") is None:
        for root in _benchmark_roots():
            if (root / "benchmarks" / "__init__.py").is_file():
                sys.path.insert(0, str(root))
                break
        else:
            raise SuiteUnavailable(
                "no benchmarks/ package found; run `pdflow bench` from the repository root"
            )
    module_name = f"benchmarks.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise SuiteUnavailable(f"benchmarks/{name}.py is not available yet") from None


def _call_run(module: ModuleType, progress: Progress, **options: Any) -> dict[str, Any]:
    """Call ``module.run`` with the options (and progress) it declares, no others."""
    accepted = inspect.signature(module.run).parameters
    chosen = {
        key: value for key, value in (options | {"progress": progress}).items() if key in accepted
    }
    result: dict[str, Any] = module.run(**chosen)
    return result


def _rows(result: dict[str, Any], source: str, keys: Sequence[str]) -> list[dict[str, Any]]:
    rows = result.get("results")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{source} returned no 'results' rows (top-level keys: {sorted(result)})")
    for row in rows:
        missing = [key for key in keys if key not in row]
        if missing:
            raise ValueError(f"{source} rows lack {missing}; each needs {list(keys)}")
    return rows


# ---- the suites ----------------------------------------------------------------------------------
def control_suite(quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Check]]:
    module = load_benchmark("control_plane")
    rows = []
    for concurrency in CONTROL_QUICK_LOADS if quick else CONTROL_LOADS:
        measured = _call_run(module, progress, rooms=concurrency)
        missing = [key for key in CONTROL_KEYS if key not in measured]
        if missing:
            raise ValueError(f"control_plane.run returned no {missing} (keys: {sorted(measured)})")
        rows.append(
            {
                "concurrency": concurrency,
                "rooms_per_second": measured["rooms_per_s"],
                "p50_ms": measured["handshake_p50_ms"],
                "p99_ms": measured["handshake_p99_ms"],
                "run": measured,
            }
        )
    row = next((r for r in rows if r["concurrency"] == CONTROL_CONCURRENCY), rows[-1])
    load = f"{row['concurrency']} concurrent rooms"
    baseline = f"SGLang 0.5.23 anchor at {CONTROL_CONCURRENCY} rooms (not side by side)"
    checks = [
        Check(
            "control",
            f"rooms/s vs SGLang, {load}",
            row["rooms_per_second"] / SGLANG_ROOMS_PER_S,
            "x",
            CONTROL_RATIO_TARGET,
            baseline=baseline,
        ),
        Check(
            "control",
            f"p99 create->Success, SGLang / pdflow, {load}",
            SGLANG_P99_MS / row["p99_ms"],
            "x",
            CONTROL_RATIO_TARGET,
            baseline=baseline,
        ),
    ]
    return {"results": rows}, checks


def sglang_suite(quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Check]]:
    """SGLang's own Mooncake managers and pdflow's nodes, two processes each, same run."""
    module = load_benchmark("sglang_side_by_side")
    try:
        result = _call_run(
            module, progress, shapes=SGLANG_QUICK_SHAPES if quick else SGLANG_SHAPES,
            repeats=1 if quick else 3, loads_4k=(64,) if quick else SGLANG_LOADS_4K,
        )  # fmt: skip
    except module.SglangUnavailable as exc:
        raise SuiteUnavailable(str(exc)) from None
    rows = _rows(result, "sglang_side_by_side.run", ("shape", "concurrency", "pdflow", "sglang"))
    baseline = f"SGLang 0.5.23's own Mooncake managers, same run, median of {result['repeats']}"
    checks = []
    for row in rows:
        load = f"{row['concurrency']} x {row['shape'].split('x')[1]}"
        control_bound = row["shape"] == "256x4K"
        if control_bound and row["concurrency"] != CONTROL_CONCURRENCY and not quick:
            continue  # the chart shows the other loads; the target is at 256 rooms
        target = CONTROL_RATIO_TARGET if control_bound else SGLANG_BIG_SHAPES_TARGET
        checks.append(Check("sglang", f"rooms/s pdflow / SGLang, {load}",
                            row["rooms_per_s_ratio"], "x", target, baseline=baseline))  # fmt: skip
        if control_bound:
            checks.append(Check("sglang", f"p99 create->Success SGLang / pdflow, {load}",
                                row["p99_ratio"], "x", CONTROL_RATIO_TARGET,
                                baseline=baseline))  # fmt: skip
            checks += _cpu_checks(row, load, baseline)
    return result, checks


def _cpu_checks(row: dict[str, Any], load: str, baseline: str) -> list[Check]:
    """Context for the control-bound ratio: on a small machine both systems are CPU-bound and
    rooms/s follows the CPU a room costs in the two processes, all threads counted."""
    if "cpu_per_room_ratio" not in row:
        return []
    return [
        Check("sglang", f"CPU per room SGLang / pdflow, {load}", row["cpu_per_room_ratio"],
              "x", None, baseline=baseline),
        *(Check("sglang", f"{name} CPU per room (both processes), {load}",
                1000 * row[system]["cpu_ms_per_room"]["total"], "us", None, baseline=baseline)
          for system, name in (("pdflow", "pdflow"), ("sglang", "SGLang"))),
    ]  # fmt: skip


def scale_suite(quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Check]]:
    """The control-plane batch at thousands of concurrent rooms: per-room cost must not grow."""
    module = load_benchmark("control_plane")
    loads = SCALE_QUICK_LOADS if quick else SCALE_LOADS
    runs: dict[int, list[dict[str, Any]]] = {load: [] for load in loads}
    for _ in range(1 if quick else SCALE_REPEATS):  # interleaved: drift hits every load alike
        for concurrency in loads:
            runs[concurrency].append(_call_run(module, progress, rooms=concurrency, trace=False))
    rows = []
    for concurrency, measured in runs.items():
        median = sorted(measured, key=lambda m: m["rooms_per_s"])[len(measured) // 2]
        rows.append({"concurrency": concurrency, "rooms_per_second": median["rooms_per_s"],
                     "p99_ms": median["handshake_p99_ms"], "runs": measured})  # fmt: skip
    rates = [row["rooms_per_second"] for row in rows]
    span = f"{rows[0]['concurrency']:,} to {rows[-1]['concurrency']:,} concurrent rooms"
    checks = [
        Check(
            "scale",
            f"slowest / fastest rooms/s (median of {len(rows[0]['runs'])}), {span}",
            min(rates) / max(rates),
            "x",
            SCALE_FLATNESS_TARGET,
            baseline="the same batch at the other loads, same run",
        )
    ]
    return {"results": rows}, checks


def data_suite(quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Check]]:
    sizes = tuple(size * MIB for size in (DATA_QUICK_SIZES_MIB if quick else DATA_SIZES_MIB))
    repeats = 3 if quick else 5
    raw = _call_run(load_benchmark("transport_raw"), progress, sizes=sizes, repeats=repeats)
    raw_rows = _rows(raw, "transport_raw.run", ("size_bytes", "pdflow_vs_raw", "raw_vs_memcpy"))
    data: dict[str, Any] = {"transport_raw": raw}
    checks: list[Check] = []
    try:
        e2e_rows = _end_to_end_rows(sizes, repeats, progress)
    except SuiteUnavailable as exc:
        progress(f"  end-to-end room benchmark: {exc}; judging the transport layer alone")
        data["pdflow_vs_raw"] = {"status": "not available", "detail": str(exc)}
        judged, what = [_closest(raw_rows, DATA_SIZE)], "pdflow transport"
    else:
        data["pdflow_vs_raw"] = {"results": e2e_rows}
        # The target holds at every size, 1 MiB to 256 MiB: each one is judged.
        judged, what = e2e_rows, "pdflow room end to end"
    for row in judged:
        size = f"{row['size_bytes'] / MIB:.0f} MiB"
        checks.append(
            Check(
                "data",
                f"{what} vs raw Mooncake, {size}",
                row["pdflow_vs_raw"],
                "x",
                DATA_RATIO_TARGET,
                baseline="raw Mooncake write of the same bytes",
            )
        )
    largest = max(raw_rows, key=lambda r: r["size_bytes"])
    checks.append(
        Check(
            "data",
            f"raw Mooncake vs memcpy, {largest['size_bytes'] / MIB:.0f} MiB",
            largest["raw_vs_memcpy"],
            "x",
            None,
            baseline="memcpy",
        )
    )
    floor_rows = _notify_floor_rows(quick, progress)
    data["engine_notify_floor"] = {"results": floor_rows}
    checks += [
        Check(
            "data",
            f"completion-word floor vs raw Mooncake, {row['bytes'] / MIB:.0f} MiB",
            row["ratio"],
            "x",
            None,
            baseline="raw write, then an 8-byte word the receiver polls for",
        )
        for row in floor_rows
    ]
    return data, checks


def _notify_floor_rows(quick: bool, progress: Progress) -> list[dict[str, Any]]:
    """The best a room could do with the cheapest correct notification (engine_notify_floor.py):
    context for the one-room target at its small sizes, not judged."""
    module = load_benchmark("engine_notify_floor")
    shapes = NOTIFY_FLOOR_QUICK if quick else NOTIFY_FLOOR_SHAPES
    return [_call_run(module, progress, size=size_mib * MIB, ops=ops,
                      rounds=NOTIFY_FLOOR_QUICK_ROUNDS if quick else NOTIFY_FLOOR_ROUNDS)
            for size_mib, ops in shapes]  # fmt: skip


def _end_to_end_rows(
    sizes: Sequence[int], repeats: int, progress: Progress
) -> list[dict[str, Any]]:
    """One room of each size through pdflow's nodes vs the raw engine (pdflow_vs_raw.py)."""
    module = load_benchmark("pdflow_vs_raw")
    rows = []
    for size in sizes:
        measured = _call_run(module, progress, size=size, repeats=repeats)
        missing = [key for key in END_TO_END_KEYS if key not in measured]
        if missing:
            raise ValueError(f"pdflow_vs_raw.run returned no {missing} (keys: {sorted(measured)})")
        rows.append({"size_bytes": measured["bytes"]} | measured)
    return rows


def _closest(rows: Sequence[dict[str, Any]], size: int) -> dict[str, Any]:
    return min(rows, key=lambda r: abs(r["size_bytes"] - size))


def hetero_suite(quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Check]]:
    in_process = load_benchmark("hetero_tp")
    over_mooncake = load_benchmark("hetero_tp_mooncake")
    shape: dict[str, int] = {"tokens": 256, "layers": 4} if quick else {}
    progress(f"hetero_tp: in-process memcpy, both paths on one shape {shape or '(full)'}")
    local = in_process.run(**shape)
    progress(f"  staged / per-slice in process: {local['staged_over_per_slice']:.1f}x")
    remote = _call_run(over_mooncake, progress, **shape, slice_layers=1 if quick else 2)
    progress(f"  staged / per-slice over Mooncake TCP: {remote['staged_over_per_slice']:.1f}x")
    checks = [
        Check(
            "hetero",
            "staged vs per-slice, Mooncake TCP (GB/s)",
            remote["staged_over_per_slice"],
            "x",
            HETERO_RATIO_TARGET,
            baseline=f"per-slice writes, {remote['per_slice']['measured_layers']} layers",
        ),
        Check(
            "hetero",
            "staged vs per-slice, in-process memcpy",
            local["staged_over_per_slice"],
            "x",
            None,
            baseline="per-slice memcpy",
        ),
    ]
    return {"in_process": local, "mooncake": remote}, checks


def core_suite(quick: bool, progress: Progress) -> tuple[dict[str, Any], list[Check]]:
    module = load_benchmark("core_steps")
    sizes = {"rooms": 1000, "memory_rooms": 5000} if quick else {}
    result = _call_run(module, progress, **sizes)
    steps, state = result["steps"], result["room_state"]
    rooms = f"{state['rooms']:,} rooms"
    checks = [
        Check(
            "core",
            "protocol steps/s on one core (driver included)",
            steps["steps_per_second"],
            "steps/s",
            CORE_STEPS_TARGET,
            baseline="target",
        ),
        Check(
            "core",
            f"core state per in-flight room, {rooms}",
            state["max_bytes_per_room"],
            "B",
            CORE_BYTES_PER_ROOM_TARGET,
            higher_is_better=False,
            baseline="target",
        ),
    ]
    return result, checks


SUITE_RUNNERS: dict[str, Callable[[bool, Progress], tuple[dict[str, Any], list[Check]]]] = {
    "control": control_suite,
    "sglang": sglang_suite,
    "scale": scale_suite,
    "data": data_suite,
    "hetero": hetero_suite,
    "core": core_suite,
}


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "class": "CPU VM, loopback, Mooncake TCP",
    }


def run_suite(name: str, quick: bool, progress: Progress) -> SuiteResult:
    """Run one suite; a missing module or a failure is recorded, never raised."""
    started = time.perf_counter()
    try:
        data, checks = SUITE_RUNNERS[name](quick, progress)
    except SuiteUnavailable as exc:
        return SuiteResult(name, "not available", str(exc), time.perf_counter() - started)
    except Exception as exc:  # a broken suite must not hide the others' figures
        detail = f"{type(exc).__name__}: {exc}"
        return SuiteResult(name, "error", detail, time.perf_counter() - started)
    return SuiteResult(name, "ok", "", time.perf_counter() - started, data, checks)


def run_bench(
    suites: Sequence[str] = SUITES,
    *,
    quick: bool = False,
    progress: Progress = print,
    on_suite: Callable[[str, SuiteResult | None], None] | None = None,
) -> BenchReport:
    """Run the named suites in order (unknown names raise ValueError before anything runs).

    ``on_suite(name, None)`` is called as a suite starts and ``on_suite(name, result)`` when it
    ends, for progress displays.
    """
    unknown = [name for name in suites if name not in SUITE_RUNNERS]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
    report = BenchReport(
        quick=quick,
        started=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=machine_info(),
    )
    for name in dict.fromkeys(suites):
        if on_suite is not None:
            on_suite(name, None)
        result = run_suite(name, quick, progress)
        report.suites.append(result)
        if on_suite is not None:
            on_suite(name, result)
    return report
