"""Every suite's figure renders to a decodable PNG from rows in its documented shape."""

from pathlib import Path

from benchmarks.core_steps import run as run_core_steps
from PIL import Image

from pdflow.bench.plots import FILE_NAMES, write_plots
from pdflow.bench.runner import MIB, BenchReport, SuiteResult


def _control_rows() -> dict[str, object]:
    return {
        "results": [
            {"concurrency": c, "rooms_per_second": 300.0 * c**0.3, "p50_ms": 40.0, "p99_ms": 90.0}
            for c in (1, 16, 64, 256)
        ]
    }


def _sglang_rows() -> dict[str, object]:
    def system(rate: float, p99: float) -> dict[str, object]:
        cpu = {"prefill_main": 0.2, "prefill_others": 0.5, "decode_main": 0.3,
               "decode_others": 0.3, "total": 1.3, "cores_busy": 1.6}  # fmt: skip
        return {"rooms_per_s": rate, "p99_ms": p99, "p50_ms": p99 / 2, "cpu_ms_per_room": cpu}

    rows = [{"shape": "256x4K", "concurrency": c, "pdflow": system(100.0 + c, 300.0),
             "sglang": system(150.0 + c, 200.0), "rooms_per_s_ratio": 0.7, "p99_ratio": 0.66}
            for c in (16, 64, 256)]  # fmt: skip
    rows += [{"shape": shape, "concurrency": n, "pdflow": system(20.0, 900.0),
              "sglang": system(18.0, 950.0), "rooms_per_s_ratio": 1.1, "p99_ratio": 1.05}
             for shape, n in (("64x1M", 64), ("4x64M", 4))]  # fmt: skip
    return {"results": rows}


def _scale_rows() -> dict[str, object]:
    rows = [{"concurrency": c, "rooms_per_second": 400.0 - c / 100, "p99_ms": 900.0}
            for c in (1000, 4000, 16000)]  # fmt: skip
    return {"results": rows}


def _data_rows() -> dict[str, object]:
    rows = [
        {
            "size_bytes": float(size * MIB),
            "memcpy_gbps": 7.0,
            "raw_mooncake_gbps": 1.0,
            "pdflow_gbps": 0.95,
            "raw_vs_memcpy": 1.0 / 7.0,
            "pdflow_vs_raw": 0.95,
        }
        for size in (1, 4, 16, 64, 256)
    ]
    return {
        "transport_raw": {"results": rows},
        "pdflow_vs_raw": {
            "results": [
                {"size_bytes": size * MIB, "pdflow_gbps": 0.9, "pdflow_vs_raw": 0.92}
                for size in (1, 64)
            ]
        },
    }


def test_every_suite_figure_is_written_and_decodes(tmp_path: Path) -> None:
    core = run_core_steps(rooms=40, in_flight=8, memory_rooms=200, progress=lambda _: None)
    hetero = {
        "in_process": {
            "staged_over_per_slice": 2.0,
            "per_slice": {"gbps": 0.2},
            "staged": {"gbps": 0.4},
        },
        "mooncake": {
            "staged_over_per_slice": 60.0,
            "per_slice": {"gbps": 0.004, "measured_layers": 2},
            "staged": {"gbps": 0.24},
            "shape": {
                "prefill_tp": 4,
                "layers": 32,
                "kv_heads": 8,
                "head_dim": 128,
                "page_size": 16,
                "tokens": 4096,
            },
            "payload_bytes": 512 * MIB,
        },
    }
    report = BenchReport(quick=True, started="now", machine={})
    report.suites = [
        SuiteResult("control", "ok", data=_control_rows()),
        SuiteResult("sglang", "ok", data=_sglang_rows()),
        SuiteResult("scale", "ok", data=_scale_rows()),
        SuiteResult("data", "ok", data=_data_rows()),
        SuiteResult("hetero", "ok", data=hetero),
        SuiteResult("core", "ok", data=core),
        SuiteResult("control", "not available", "benchmarks/control_plane.py is missing"),
    ]
    written = write_plots(report, tmp_path)
    assert [path.name for path in written] == [FILE_NAMES[name] for name in FILE_NAMES]
    for path in written:
        with Image.open(path) as image:
            image.load()
            assert image.format == "PNG"


def test_core_steps_counts_every_handle_call_of_every_room() -> None:
    result = run_core_steps(rooms=30, in_flight=7, memory_rooms=100, progress=lambda _: None)
    steps, state = result["steps"], result["room_state"]
    # Per room: prefill open, metadata, init, 2 chunks, 2 transfers done, clear; decode open,
    # publish, success, clear. One topology answer for the whole run.
    assert steps["handle_calls"] == 30 * 12 + 1
    assert steps["steps_per_second"] > 0
    assert 0 < state["decode_bytes_per_room"] < 100_000
    assert 0 < state["prefill_bytes_per_room"] < 100_000
