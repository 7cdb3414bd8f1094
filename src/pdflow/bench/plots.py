"""PNG figures of a bench report: every panel plots a ratio to its baseline or target.

One figure per suite that ran; the dashed line in each panel is the target. matplotlib runs on
the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdflow.bench.runner import (
    CONTROL_RATIO_TARGET,
    CORE_BYTES_PER_ROOM_TARGET,
    CORE_STEPS_TARGET,
    DATA_RATIO_TARGET,
    HETERO_RATIO_TARGET,
    MIB,
    SCALE_FLATNESS_TARGET,
    SGLANG_P99_MS,
    SGLANG_ROOMS_PER_S,
    BenchReport,
    SuiteResult,
)

FILE_NAMES = {
    "control": "control_plane.png",
    "sglang": "sglang_side_by_side.png",
    "scale": "room_scale.png",
    "data": "data_plane.png",
    "hetero": "hetero_tp.png",
    "core": "core.png",
}
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _target_line(axis: Any, value: float, label: str) -> None:
    axis.axhline(value, color="black", linestyle="--", linewidth=1.2, label=label)


def _bars(
    axis: Any,
    labels: Sequence[str],
    values: Sequence[float],
    notes: Sequence[str],
    *,
    log: bool = False,
    reference: float | None = None,
) -> None:
    """Bars with their note above each, and head room above the tallest bar (or the
    ``reference`` line) for the notes and an upper-left legend."""
    positions = range(len(values))
    bars = axis.bar(positions, values, color=_COLORS[: len(values)], width=0.6)
    axis.set_xticks(list(positions), labels)
    for bar, note in zip(bars, notes, strict=True):
        axis.annotate(
            note,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    top = max([*values, reference or 0.0])
    if log:
        _plain_log_y(axis)
        axis.set_ylim(min(values) / 3, top * 12)
    else:
        axis.set_ylim(0, top * 1.45)


def _log2_axis(axis: Any, ticks: Sequence[float], label: str) -> None:
    """A log2 x axis labelled with the measured values themselves (1, 4, 16, not 2^n)."""
    from matplotlib.ticker import NullLocator

    axis.set_xscale("log", base=2)
    axis.set_xticks(list(ticks), [f"{tick:g}" for tick in ticks])
    axis.xaxis.set_minor_locator(NullLocator())
    axis.set_xlabel(label)


def _plain_log_y(axis: Any) -> None:
    """Log y axis with plain numbers (0.3, 1, 6) rather than powers of ten."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    axis.set_yscale("log")
    axis.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    axis.yaxis.set_minor_formatter(FormatStrFormatter("%g"))


def _note_points(axis: Any, xs: Sequence[float], ys: Sequence[float], notes: Sequence[str]) -> None:
    for x, y, note in zip(xs, ys, notes, strict=True):
        axis.annotate(
            note, (x, y), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8
        )


def _control(plt: Any, data: dict[str, Any]) -> Any:
    rows = sorted(data["results"], key=lambda r: r["concurrency"])
    concurrency = [r["concurrency"] for r in rows]
    figure, (rate, latency) = plt.subplots(1, 2, figsize=(12, 4.8))
    rates = [r["rooms_per_second"] / SGLANG_ROOMS_PER_S for r in rows]
    rate.plot(concurrency, rates, "o-", label="pdflow rooms/s ÷ SGLang rooms/s")
    _note_points(rate, concurrency, rates, [f"{r['rooms_per_second']:.0f}/s" for r in rows])
    rate.set_title(f"Rooms per second ÷ SGLang's {SGLANG_ROOMS_PER_S:.0f} rooms/s")
    latencies = [SGLANG_P99_MS / r["p99_ms"] for r in rows]
    latency.plot(concurrency, latencies, "o-", color=_COLORS[1], label="SGLang p99 ÷ pdflow p99")
    _note_points(latency, concurrency, latencies, [f"{r['p99_ms']:.0f} ms" for r in rows])
    latency.set_title(f"create→Success p99: SGLang's {SGLANG_P99_MS:.0f} ms ÷ pdflow's")
    for axis, values in ((rate, rates), (latency, latencies)):
        _target_line(axis, CONTROL_RATIO_TARGET, f"target {CONTROL_RATIO_TARGET:g}x")
        _log2_axis(axis, concurrency, "concurrent rooms (4 KiB each)")
        axis.set_ylim(0, max([*values, CONTROL_RATIO_TARGET]) * 1.5)
        axis.set_ylabel("ratio (higher is better)")
        axis.grid(True, alpha=0.3)
        axis.legend(loc="upper right")
    figure.suptitle(
        "Control plane vs SGLang 0.5.23 (its anchor at 256 rooms, measured on this machine class)"
    )
    return figure


def _sglang(plt: Any, data: dict[str, Any]) -> Any:
    """Both systems on one chart: rooms/s and p99 against concurrent 4 KiB rooms, and the
    rooms/s ratio per shape."""
    rows = data["results"]
    small = sorted((r for r in rows if r["shape"] == "256x4K"), key=lambda r: r["concurrency"])
    with_cpu = bool(small) and "cpu_ms_per_room" in small[-1]["pdflow"]
    figure, axes = plt.subplots(1, 4 if with_cpu else 3, figsize=(21 if with_cpu else 16, 4.8))
    rate, latency, ratio = axes[:3]
    if with_cpu:
        _cpu_per_room(axes[3], small[-1])
    for axis, key, title in ((rate, "rooms_per_s", "rooms/s (higher is better)"),
                             (latency, "p99_ms", "create→Success p99, ms (lower is better)")):
        xs = [r["concurrency"] for r in small]
        for index, (system, label) in enumerate((("pdflow", "pdflow"),
                                                 ("sglang", "SGLang 0.5.23"))):
            ys = [r[system][key] for r in small]
            axis.plot(xs, ys, "o-", color=_COLORS[index], label=label)
            _note_points(axis, xs, ys, [f"{y:.0f}" for y in ys])
        _log2_axis(axis, xs or [1], "concurrent rooms (4 KiB each)")
        axis.set_title(title)
        axis.set_ylim(0, max([1.0] + [r[s][key] for r in small for s in ("pdflow", "sglang")])
                      * 1.3)  # fmt: skip
        axis.grid(True, alpha=0.3)
        axis.legend(loc="upper left")
    headline = [r for r in rows if r["shape"] != "256x4K" or r is (small[-1] if small else None)]
    labels = [f"{r['concurrency']} x {r['shape'].split('x')[1]}" for r in headline]
    values = [r["rooms_per_s_ratio"] for r in headline]
    _bars(ratio, labels, values, [f"{v:.2f}x" for v in values], reference=CONTROL_RATIO_TARGET)
    _target_line(ratio, CONTROL_RATIO_TARGET, f"target {CONTROL_RATIO_TARGET:g}x (4 KiB)")
    _target_line(ratio, 1.0, "target 1x (1 MiB, 64 MiB)")
    ratio.set_title("rooms/s, pdflow ÷ SGLang")
    ratio.legend(loc="upper right")
    figure.suptitle("pdflow vs SGLang 0.5.23's own Mooncake managers, same run, two processes "
                    "each (median of the batches)")
    return figure


_CPU_PARTS = (
    ("prefill_main", "prefill: scheduler thread"),
    ("prefill_others", "prefill: other threads"),
    ("decode_main", "decode: scheduler thread"),
    ("decode_others", "decode: other threads"),
)


def _cpu_per_room(axis: Any, row: dict[str, Any]) -> None:
    """Stacked bars: each system's CPU per room at the control-bound load, by process and thread
    group, with the total and the cores kept busy above each bar."""
    systems = (("pdflow", "pdflow"), ("sglang", "SGLang 0.5.23"))
    bottoms = [0.0, 0.0]
    for index, (part, label) in enumerate(_CPU_PARTS):
        heights = [row[system]["cpu_ms_per_room"].get(part, 0.0) for system, _ in systems]
        axis.bar([0, 1], heights, bottom=bottoms, width=0.6, color=_COLORS[index], label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for position, (system, _) in enumerate(systems):
        cpu = row[system]["cpu_ms_per_room"]
        axis.annotate(f"{cpu['total']:.2f} ms, {cpu['cores_busy']:.1f} cores",
                      (position, bottoms[position]), xytext=(0, 4), textcoords="offset points",
                      ha="center", va="bottom", fontsize=9)  # fmt: skip
    axis.set_xticks([0, 1], [name for _, name in systems])
    axis.set_ylim(0, max(bottoms) * 1.6)
    axis.set_ylabel("CPU ms per room, all threads")
    axis.set_title(f"CPU per room at {row['concurrency']} x 4 KiB (lower is better)")
    axis.legend(loc="upper left", fontsize=8)


def _scale(plt: Any, data: dict[str, Any]) -> Any:
    rows = sorted(data["results"], key=lambda r: r["concurrency"])
    concurrency = [r["concurrency"] for r in rows]
    fastest = max(r["rooms_per_second"] for r in rows)
    figure, axis = plt.subplots(1, 1, figsize=(7, 4.8))
    ratios = [r["rooms_per_second"] / fastest for r in rows]
    axis.plot(concurrency, ratios, "o-", label="rooms/s ÷ the fastest load's")
    _note_points(axis, concurrency, ratios, [f"{r['rooms_per_second']:.0f}/s" for r in rows])
    _target_line(axis, SCALE_FLATNESS_TARGET, f"target ≥ {SCALE_FLATNESS_TARGET:g}")
    _log2_axis(axis, concurrency, "concurrent rooms (4 KiB each)")
    axis.set_ylim(0, 1.3)
    axis.set_ylabel("ratio (higher is better)")
    axis.grid(True, alpha=0.3)
    axis.legend(loc="lower left")
    figure.suptitle("Per-room cost against the number of concurrent rooms (flat within 20%)")
    return figure


def _data(plt: Any, data: dict[str, Any]) -> Any:
    rows = sorted(data["transport_raw"]["results"], key=lambda r: r["size_bytes"])
    sizes = [r["size_bytes"] / MIB for r in rows]
    end_to_end = data.get("pdflow_vs_raw", {})
    e2e = sorted(end_to_end.get("results", []), key=lambda r: r["size_bytes"])
    e2e_sizes = [r["size_bytes"] / MIB for r in e2e]
    figure, (ratio, speed) = plt.subplots(1, 2, figsize=(12, 4.8))
    ratios = [r["pdflow_vs_raw"] for r in [*rows, *e2e]]
    ratio.plot(sizes, [r["pdflow_vs_raw"] for r in rows], "o-", label="pdflow transport ÷ raw")
    if e2e:
        ratio.plot(
            e2e_sizes, [r["pdflow_vs_raw"] for r in e2e], "^-", label="pdflow room end to end ÷ raw"
        )
    ratio.plot(sizes, [r["raw_vs_memcpy"] for r in rows], "s-", label="raw Mooncake ÷ memcpy")
    _target_line(ratio, DATA_RATIO_TARGET, f"target {DATA_RATIO_TARGET:g} (pdflow ÷ raw)")
    ratio.set_ylim(0, max([*ratios, 1.0]) * 1.5)
    ratio.set_ylabel("ratio")
    ratio.set_title("Throughput ratios, same bytes, same run")
    lines = [
        ("memcpy", sizes, [r["memcpy_gbps"] for r in rows]),
        ("raw Mooncake TCP", sizes, [r["raw_mooncake_gbps"] for r in rows]),
        ("pdflow transport", sizes, [r["pdflow_gbps"] for r in rows]),
    ]
    if e2e:
        lines.append(("pdflow room end to end", e2e_sizes, [r["pdflow_gbps"] for r in e2e]))
    for label, xs, ys in lines:
        speed.plot(xs, ys, "o-", label=label)
    _plain_log_y(speed)
    speeds = [y for _, _, ys in lines for y in ys]
    speed.set_ylim(min(speeds) / 2, max(speeds) * 8)  # room at the top for the legend
    speed.set_ylabel("GB/s")
    speed.set_title("Absolute throughput (for context)")
    for axis in (ratio, speed):
        _log2_axis(axis, sizes, "write size (MiB)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=9, loc="upper left", ncols=2)
    figure.suptitle("Data plane: N MiB over loopback, pdflow against the raw engine")
    return figure


def _hetero(plt: Any, data: dict[str, Any]) -> Any:
    local, remote = data["in_process"], data["mooncake"]
    figure, (speedup, speed) = plt.subplots(1, 2, figsize=(12, 4.8))
    ratios = [local["staged_over_per_slice"], remote["staged_over_per_slice"]]
    _bars(
        speedup,
        ["in-process memcpy", "Mooncake TCP"],
        ratios,
        [f"{r:.1f}x" for r in ratios],
        log=True,
        reference=HETERO_RATIO_TARGET,
    )
    _target_line(speedup, HETERO_RATIO_TARGET, f"target {HETERO_RATIO_TARGET:g}x (transport)")
    speedup.set_ylabel("staged GB/s ÷ per-slice GB/s")
    speedup.set_title("Staged (gather, 1 write/rank, scatter) vs per-slice")
    speedup.legend(loc="upper left")
    layers = f"{remote['per_slice']['measured_layers']} of {remote['shape']['layers']} layers"
    labels = [
        "memcpy\nper-slice",
        "memcpy\nstaged",
        f"TCP per-slice\n({layers})",
        "TCP staged",
    ]
    values = [
        local["per_slice"]["gbps"],
        local["staged"]["gbps"],
        remote["per_slice"]["gbps"],
        remote["staged"]["gbps"],
    ]
    _bars(speed, labels, values, [f"{v:.3g}" for v in values], log=True)
    speed.set_ylabel("GB/s of KV moved")
    speed.set_title("Throughput of each path")
    shape = remote["shape"]
    figure.suptitle(
        f"Heterogeneous TP {shape['prefill_tp']}→1: {shape['layers']} layers, "
        f"{shape['kv_heads']} KV heads × {shape['head_dim']}, page {shape['page_size']}, "
        f"{shape['tokens']} tokens ({remote['payload_bytes'] / MIB:.0f} MiB)"
    )
    return figure


def _core(plt: Any, data: dict[str, Any]) -> Any:
    steps, state = data["steps"], data["room_state"]
    figure, (rate, memory) = plt.subplots(1, 2, figsize=(12, 4.8))
    values = [steps["steps_per_second"], steps["core_steps_per_second"]]
    _bars(
        rate,
        ["whole run\n(driver included)", "inside handle()\nalone"],
        [v / CORE_STEPS_TARGET for v in values],
        [f"{v:,.0f} steps/s" for v in values],
        reference=1.0,
    )
    _target_line(rate, 1.0, f"target {CORE_STEPS_TARGET:,.0f} steps/s")
    rate.set_ylabel("steps/s ÷ target (higher is better)")
    rate.set_title(f"Protocol steps per second, one core ({steps['rooms']:,} rooms)")
    rate.legend(loc="upper left")
    sizes = [state["decode_bytes_per_room"], state["prefill_bytes_per_room"]]
    _bars(
        memory,
        ["decode endpoint", "prefill endpoint"],
        [v / CORE_BYTES_PER_ROOM_TARGET for v in sizes],
        [f"{v:,.0f} B" for v in sizes],
        reference=1.0,
    )
    _target_line(memory, 1.0, f"budget {CORE_BYTES_PER_ROOM_TARGET:,.0f} B")
    memory.set_ylabel("bytes per room ÷ budget (lower is better)")
    memory.set_title(f"State per in-flight room ({state['rooms']:,} rooms, Transferring)")
    memory.legend(loc="upper left")
    figure.suptitle("Pure protocol core, in process, no I/O")
    return figure


_FIGURES: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "control": _control,
    "sglang": _sglang,
    "scale": _scale,
    "data": _data,
    "hetero": _hetero,
    "core": _core,
}


def write_suite_plot(suite: SuiteResult, out_dir: Path) -> Path | None:
    """Write the suite's figure; None when the suite has no figures (it did not run)."""
    if suite.status != "ok":
        return None
    plt = _pyplot()
    figure = _FIGURES[suite.name](plt, suite.data)
    figure.tight_layout()
    path = out_dir / FILE_NAMES[suite.name]
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_plots(report: BenchReport, out_dir: Path) -> list[Path]:
    """One PNG per suite that ran, in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_suite_plot(suite, out_dir) for suite in report.suites]
    return [path for path in written if path is not None]
