"""The bench runner's judging, loading and suite bookkeeping, without running long benchmarks."""

from types import ModuleType
from typing import Any

import pytest

from pdflow.bench.runner import (
    SUITE_RUNNERS,
    Check,
    SuiteUnavailable,
    _call_run,
    load_benchmark,
    run_bench,
    run_suite,
)


def test_verdicts_follow_the_direction_of_the_target() -> None:
    assert Check("s", "m", 2.0, "x", 2.0).verdict == "pass"
    assert Check("s", "m", 1.9, "x", 2.0).verdict == "miss"
    assert Check("s", "m", 2048, "B", 2048, higher_is_better=False).verdict == "pass"
    assert Check("s", "m", 2049, "B", 2048, higher_is_better=False).verdict == "miss"
    assert Check("s", "m", 0.1, "x", None).verdict == "info"


def test_a_missing_benchmark_module_is_unavailable_not_an_error() -> None:
    with pytest.raises(SuiteUnavailable, match=r"benchmarks/no_such_suite\.py is not available"):
        load_benchmark("no_such_suite")
    assert load_benchmark("core_steps").__name__ == "benchmarks.core_steps"


def test_run_gets_only_the_options_it_declares() -> None:
    module = ModuleType("fake_benchmark")
    seen: dict[str, Any] = {}

    def run(*, quick: bool) -> dict[str, Any]:
        seen["quick"] = quick
        return {"results": []}

    module.run = run  # type: ignore[attr-defined]
    assert _call_run(module, print, quick=True, sizes=(1,)) == {"results": []}
    assert seen == {"quick": True}


def test_unknown_suite_names_are_refused_before_anything_runs() -> None:
    started: list[str] = []
    with pytest.raises(ValueError, match="unknown suite"):
        run_bench(["core", "nope"], on_suite=lambda name, _: started.append(name))
    assert started == []


def test_a_failing_suite_is_recorded_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(quick: bool, progress: Any) -> Any:
        raise RuntimeError("engine on fire")

    monkeypatch.setitem(SUITE_RUNNERS, "core", broken)
    result = run_suite("core", quick=True, progress=print)
    assert (result.status, result.detail, result.checks) == (
        "error",
        "RuntimeError: engine on fire",
        [],
    )


def test_without_sglang_the_side_by_side_suite_says_so_and_the_rest_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    monkeypatch.setenv("PDFLOW_SGLANG_PYTHON", str(missing))
    report = run_bench(["sglang", "core"], quick=True, progress=lambda line: None)
    sglang, core = report.suites
    assert sglang.status == "not available", sglang
    assert "SGLang is not installed" in sglang.detail
    assert "scripts/setup_sglang.sh" in sglang.detail
    assert core.status == "ok" and core.checks


def test_the_side_by_side_suite_reports_cpu_per_room_as_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdflow.bench.runner import sglang_suite

    def system(rooms_per_s: float, cpu_ms: float) -> dict[str, Any]:
        return {"rooms_per_s": rooms_per_s, "p99_ms": 100.0,
                "cpu_ms_per_room": {"total": cpu_ms, "cores_busy": 1.5}}  # fmt: skip

    row = {"shape": "256x4K", "concurrency": 256, "rooms_per_s_ratio": 1.5, "p99_ratio": 1.4,
           "cpu_per_room_ratio": 1.25, "pdflow": system(1200, 1.2),
           "sglang": system(800, 1.5)}  # fmt: skip
    module = load_benchmark("sglang_side_by_side")
    monkeypatch.setattr(module, "run", lambda **_: {"repeats": 3, "results": [row]})
    _result, checks = sglang_suite(quick=False, progress=print)
    judged = {check.measure: (check.value, check.verdict) for check in checks}
    assert judged["rooms/s pdflow / SGLang, 256 x 4K"] == (1.5, "miss")
    assert judged["CPU per room SGLang / pdflow, 256 x 4K"] == (1.25, "info")
    assert judged["pdflow CPU per room (both processes), 256 x 4K"] == (1200.0, "info")
    assert judged["SGLang CPU per room (both processes), 256 x 4K"] == (1500.0, "info")


def test_the_data_suite_reports_the_completion_word_floor_as_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdflow.bench import runner

    calls: list[dict[str, Any]] = []

    def floor(*, size: int, ops: int, rounds: int) -> dict[str, Any]:
        calls.append({"size": size, "ops": ops, "rounds": rounds})
        return {"bytes": size, "ops": ops, "ratio": 0.85}

    def transport_raw(**_: Any) -> dict[str, Any]:
        return {"results": [{"size_bytes": runner.MIB, "pdflow_vs_raw": 0.5, "raw_vs_memcpy": 0.2}]}

    modules = {"engine_notify_floor": floor, "transport_raw": transport_raw}

    def load(name: str) -> ModuleType:
        if name not in modules:
            raise SuiteUnavailable(f"benchmarks/{name}.py is not available")
        module = ModuleType(name)
        module.run = modules[name]  # type: ignore[attr-defined]
        return module

    monkeypatch.setattr(runner, "load_benchmark", load)
    data, checks = runner.data_suite(quick=False, progress=print)
    assert [(c["size"], c["ops"]) for c in calls] == [(runner.MIB, 4), (4 * runner.MIB, 4)]
    assert {c["rounds"] for c in calls} == {runner.NOTIFY_FLOOR_ROUNDS}
    floors = [c for c in checks if c.measure.startswith("completion-word floor")]
    assert [(c.measure, c.value, c.verdict) for c in floors] == [
        ("completion-word floor vs raw Mooncake, 1 MiB", 0.85, "info"),
        ("completion-word floor vs raw Mooncake, 4 MiB", 0.85, "info"),
    ]
    assert len(data["engine_notify_floor"]["results"]) == 2
