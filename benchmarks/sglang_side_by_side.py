"""SGLang 0.5.23's own Mooncake managers and pdflow's nodes, side by side in one run.

Both systems run through the same stand-in SGLang scheduler (``tests_sglang/driver.py``, which
drives a transfer backend in SGLang's queue order), prefill and decode as two processes over
Mooncake TCP on loopback: ``--backend mooncake`` is SGLang's own ``MooncakeKVManager`` /
sender / receiver, ``--backend pdflow`` is pdflow's prefill and decode nodes behind SGLang's
interface. Same geometry, same rooms, every byte checked by the decode. Each shape runs its
``repeats`` batches (at each load) on one process pair per system, the systems alternating
batch by batch so machine drift hits both alike; each figure is the median over the batches.
Each pair first moves a warm-up batch of ``WARM_UP_ROOMS`` rooms (not measured), and the
drivers run with structlog below WARNING off (``--quiet-logs``), as ``pdflow bench`` does in
process. The requests of a batch reach the prefill driver when the decode's do, as a router
sends them to both (``--requests-on-stdin``): each system's prefill holds and polls senders only
for the batch in flight, as a scheduler would, never for every later batch of the run too.
The 4 KiB shape also runs at 16 and 64 concurrent rooms, for the chart against concurrency.

Shapes (SGLang's float32 pool, one buffer per layer for K and for V):

* 256 rooms x 4 KiB: 2 layers, 1 head x 16, page 16, 1 page per room (control-plane bound);
* 64 rooms x 1 MiB: 16 layers, 2 heads x 64, page 16, 4 pages;
* 4 rooms x 64 MiB: 32 layers, 8 heads x 128, page 16, 16 pages (data bound).

SGLang lives in its own environment (``scripts/setup_sglang.sh`` builds ``.venv-sglang``);
``PDFLOW_SGLANG_PYTHON`` names another interpreter. Without one, :func:`run` raises
``SglangUnavailable`` saying how to install it, and ``pdflow bench`` reports the suite as not
available while the rest runs.

    python -m benchmarks.sglang_side_by_side --shapes 256x4K --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import write_json
from benchmarks.process_cpu import CpuMeter, CpuSplit

ROOT = Path(__file__).resolve().parents[1]
SHAPES: dict[str, dict[str, int]] = {
    "256x4K": {"rooms": 256, "num_layers": 2, "heads": 1, "head_dim": 16, "pages": 1},
    "64x1M": {"rooms": 64, "num_layers": 16, "heads": 2, "head_dim": 64, "pages": 4},
    "4x64M": {"rooms": 4, "num_layers": 32, "heads": 8, "head_dim": 128, "pages": 16},
}
PAGE_TOKENS = 16
SYSTEMS = ("mooncake", "pdflow")  # SGLang's own backend first, then pdflow's
STARTUP_S = 300.0
WARM_UP_ROOMS = 8
"""Rooms each process pair moves before the measured batches (connections, topology, first
calls), for both systems alike; control_plane.py warms up the same way."""
BATCH_S = 300.0


class SglangUnavailable(RuntimeError):
    """No interpreter with SGLang 0.5.23 was found; nothing was measured."""


def sglang_python() -> str:
    """The interpreter of the SGLang environment, checked to import SGLang's managers."""
    python = os.environ.get("PDFLOW_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
    if not Path(python).exists():
        raise SglangUnavailable(
            f"SGLang is not installed ({python} does not exist): run scripts/setup_sglang.sh, "
            "or set PDFLOW_SGLANG_PYTHON to an interpreter with sglang==0.5.23"
        )
    probe = subprocess.run(
        [python, "-c", "import sglang.srt.disaggregation.mooncake.conn"],
        capture_output=True, text=True, timeout=300, env=_child_env(),
    )  # fmt: skip
    if probe.returncode != 0:
        raise SglangUnavailable(
            f"{python} cannot import SGLang's Mooncake managers: "
            f"{probe.stderr.strip().splitlines()[-1:] or probe.returncode}; "
            "re-run scripts/setup_sglang.sh"
        )
    return python


def _child_env() -> dict[str, str]:
    # This checkout's pdflow first, whatever the SGLang environment has installed.
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "PDFLOW_TRACE": "0", "MC_LOG_LEVEL": "ERROR"}  # fmt: skip


def room_bytes(shape: dict[str, int]) -> int:
    return shape["num_layers"] * 2 * shape["pages"] * PAGE_TOKENS * shape["heads"] * (
        shape["head_dim"] * 4
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Pair:
    """One system's prefill (hosting the bootstrap server) and decode processes."""

    def __init__(self, system: str, shape: dict[str, int], total_rooms: int, python: str,
                 logs: Path) -> None:  # fmt: skip
        from tests.ports import free_port
        from tests_sglang.processes import DriverProcess

        self.port = free_port()
        geometry = [
            "--num-layers", str(shape["num_layers"]), "--heads", str(shape["heads"]),
            "--head-dim", str(shape["head_dim"]), "--page-size", str(PAGE_TOKENS),
            "--pages-per-room", str(shape["pages"]), "--chunk-pages", str(shape["pages"]),
            "--pool-pages", str(total_rooms * shape["pages"] + shape["pages"]),
            "--aux-slots", str(total_rooms),
        ]  # fmt: skip
        common = ["--backend", system, "--bootstrap-port", str(self.port), "--quiet-logs",
                  *geometry]  # fmt: skip
        env = _child_env()
        self.prefill = DriverProcess(
            "prefill", *common, "--serve-bootstrap", "--rooms", str(total_rooms),
            "--requests-on-stdin",
            "--room-base", "1000", "--http-port", str(free_port()), "--serve-s", "3600",
            log_dir=logs, python=python, env=env,
        )  # fmt: skip
        self.decode = DriverProcess("decode", *common, "--http-port", str(free_port()),
                                    log_dir=logs, python=python, env=env)  # fmt: skip
        self.next_base = 1000
        self.cpu = CpuMeter({"prefill": self.prefill.proc.pid, "decode": self.decode.proc.pid})

    def ready(self) -> None:
        self.prefill.wait_for("prefill_ready", timeout=STARTUP_S)
        self.decode.wait_for("decode_ready", timeout=STARTUP_S)

    def batch(self, rooms: int) -> dict[str, Any]:
        """``rooms`` rooms opened at once by the decode; rooms/s and create->Success latency."""
        base, self.next_base = self.next_base, self.next_base + rooms
        self.cpu.start()
        started = time.monotonic()
        # The router sends the batch's requests to both instances at once: the prefill holds
        # senders only for the requests it was sent (not for every batch of the run).
        self.prefill.command(cmd="requests", count=rooms)
        # Room ids run on from batch to batch, as the prefill numbers its KV patterns.
        self.decode.command(cmd="batch", count=rooms, base=base, bootstrap_port=self.port,
                            first_index=base - 1000)  # fmt: skip
        done = self.decode.wait_for("batch_done", timeout=BATCH_S, base=base)
        cpu = self.cpu.stop()
        finished = [e for e in self.decode.seen("receiver_success")
                    if base <= e["room"] < base + rooms]  # fmt: skip
        if done["success"] != rooms or done["wrong_pages"]:
            raise RuntimeError(f"batch at room {base}: {done}; logs {self.decode.log_path}")
        latencies = [e["received_at"] - started for e in finished]
        return {
            "rooms": rooms,
            "seconds": done["seconds"],
            "rooms_per_s": done["rooms_per_s"],
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * _percentile(latencies, 0.99),
            "cpu_s": _cpu_parts(cpu),
        }

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()


def _cpu_parts(cpu: dict[str, CpuSplit]) -> dict[str, float]:
    # "prefill_main", "prefill_others", "decode_main", "decode_others": seconds
    return {f"{role}_main": split.main for role, split in cpu.items()} | {
        f"{role}_others": split.others for role, split in cpu.items()
    }


def cpu_per_room(batches: list[dict[str, Any]]) -> dict[str, float]:
    """CPU milliseconds per room over all of a system's batches, by process and thread group
    (``main`` is the scheduler's thread), with their ``total``; and the cores those threads kept
    busy over the batches' wall time (``cores_busy``)."""
    rooms = sum(batch["rooms"] for batch in batches)
    seconds = sum(batch["seconds"] for batch in batches)
    if rooms < 1 or seconds <= 0:
        raise ValueError("need at least one batch with rooms and a duration")
    parts: dict[str, float] = {}
    for batch in batches:
        for part, used in batch["cpu_s"].items():
            parts[part] = parts.get(part, 0.0) + used
    total = sum(parts.values())
    return {**{part: 1000 * used / rooms for part, used in parts.items()},
            "total": 1000 * total / rooms, "cores_busy": total / seconds}  # fmt: skip


def measure_shape(name: str, loads: tuple[int, ...], repeats: int, python: str, logs: Path,
                  progress: Callable[[str], None]) -> list[dict[str, Any]]:  # fmt: skip
    """One row per load (concurrent rooms) of this shape, both systems, median of repeats."""
    shape = SHAPES[name]
    warm_up = min(WARM_UP_ROOMS, min(loads))
    total = sum(loads) * repeats + warm_up
    pairs = {system: _Pair(system, shape, total, python, logs) for system in SYSTEMS}
    batches: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for pair in pairs.values():
            pair.ready()
        for pair in pairs.values():
            pair.batch(warm_up)  # connections and first-use costs, not measured
        for _ in range(repeats):
            for load in loads:
                for system, pair in pairs.items():  # alternating: drift hits both alike
                    batch = pair.batch(load)
                    batches.setdefault((system, load), []).append(batch)
                    cpu = cpu_per_room([batch])
                    progress(f"  {name} x{load} {system}: {batch['rooms_per_s']:.0f} rooms/s, "
                             f"p99 {batch['p99_ms']:.0f} ms, CPU {cpu['total']:.2f} ms/room "
                             f"({cpu['cores_busy']:.1f} cores busy)")  # fmt: skip
    finally:
        for pair in pairs.values():
            pair.stop()
    rows = []
    for load in loads:
        row: dict[str, Any] = {"shape": name, "concurrency": load,
                               "room_bytes": room_bytes(shape)}  # fmt: skip
        for system in SYSTEMS:
            runs = batches[(system, load)]
            rate = statistics.median(r["rooms_per_s"] for r in runs)
            row["sglang" if system == "mooncake" else "pdflow"] = {
                "rooms_per_s": rate,
                "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                "gbps": rate * room_bytes(shape) / 1e9,
                "cpu_ms_per_room": cpu_per_room(runs),
                "batches": runs,
            }
        row["rooms_per_s_ratio"] = row["pdflow"]["rooms_per_s"] / row["sglang"]["rooms_per_s"]
        row["p99_ratio"] = row["sglang"]["p99_ms"] / row["pdflow"]["p99_ms"]
        row["cpu_per_room_ratio"] = (row["sglang"]["cpu_ms_per_room"]["total"]
                                     / row["pdflow"]["cpu_ms_per_room"]["total"])  # fmt: skip
        rows.append(row)
    return rows


def run(shapes: tuple[str, ...] = tuple(SHAPES), repeats: int = 3,
        progress: Callable[[str], None] = print,
        loads_4k: tuple[int, ...] = (16, 64, 256)) -> dict[str, Any]:  # fmt: skip
    """Every shape on both systems (the 4 KiB shape at each of ``loads_4k`` concurrent rooms);
    raises SglangUnavailable when SGLang is not installed."""
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown or repeats < 1:
        raise ValueError(f"shapes must be among {list(SHAPES)} (got {unknown}), repeats >= 1")
    python = sglang_python()
    logs = Path(tempfile.mkdtemp(prefix="pdflow-sglang-bench-"))
    results = []
    for name in shapes:
        loads = loads_4k if name == "256x4K" else (SHAPES[name]["rooms"],)
        progress(f"sglang_side_by_side: {name} at {loads} rooms, {repeats} batches per system "
                 f"(logs {logs})")  # fmt: skip
        results += measure_shape(name, loads, repeats, python, logs, progress)
    return {"benchmark": "sglang_side_by_side", "repeats": repeats, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of "
                        + ", ".join(SHAPES))  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loads-4k", default="16,64,256",
                        help="concurrent rooms of the 4 KiB shape (comma-separated)")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    loads = tuple(int(n) for n in args.loads_4k.split(","))
    result = run(tuple(args.shapes.split(",")), args.repeats, loads_4k=loads)
    for row in result["results"]:
        keys = ("shape", "concurrency", "rooms_per_s_ratio", "p99_ratio", "cpu_per_room_ratio")
        print(json.dumps({k: row[k] for k in keys}))
    if args.json:
        write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
