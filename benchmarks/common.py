"""Small helpers every benchmark script shares."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second); infinite when nothing measurable elapsed."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write a benchmark's result where ``--json`` asked, and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def latency_summary(seconds: list[float]) -> dict[str, float]:
    """Median, p10 and p90 of a list of durations, in microseconds."""
    us = sorted(v * 1e6 for v in seconds)
    return {"median_us": statistics.median(us), "p10_us": us[len(us) // 10],
            "p90_us": us[len(us) * 9 // 10]}  # fmt: skip


def raw_engine(host: str = "127.0.0.1") -> Any:
    """A bare Mooncake engine over TCP (P2P handshake), as the raw baselines use it."""
    from pdflow.transport.mooncake import load_engine_class

    engine = load_engine_class()()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"Mooncake engine failed to initialise on {host}")
    return engine
