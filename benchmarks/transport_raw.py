"""Raw data-plane throughput: memcpy vs Mooncake's own write vs pdflow's Mooncake transport.

All three move the same bytes between the same two buffers in one process (engines talk over
TCP on loopback), measured side by side in one run and interleaved per repeat, because figures
on a shared VM drift by tens of percent between runs. Each figure is the median of the repeats.

    python benchmarks/transport_raw.py --sizes 1M,16M,64M,256M --repeats 5 --json out/raw.json

`run(...)` returns the same figures as a dict, for `pdflow bench`.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import anyio

from benchmarks.common import gbps, raw_engine, write_json
from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport

MIB = 1 << 20
DEFAULT_SIZES = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
_UNITS = {"K": 1 << 10, "M": MIB, "G": 1 << 30}


class Op(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


def parse_size(text: str) -> int:
    """'64M' -> 67108864; plain numbers are bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)



async def _measure(
    sizes: Sequence[int], repeats: int, host: str, progress: Callable[[str], None]
) -> list[dict[str, float]]:
    capacity = max(sizes)
    src = ctypes.create_string_buffer((bytes(range(256)) * (capacity // 256 + 1))[:capacity])
    dst = ctypes.create_string_buffer(capacity)
    src_addr, dst_addr = ctypes.addressof(src), ctypes.addressof(dst)

    raw_sender, raw_receiver = raw_engine(host), raw_engine(host)
    for engine, addr in ((raw_sender, src_addr), (raw_receiver, dst_addr)):
        if engine.register_memory(addr, capacity) != 0:
            raise RuntimeError("Mooncake refused to register the benchmark buffers")
    raw_peer = f"{host}:{raw_receiver.get_rpc_port()}"

    config = MooncakeConfig(host=host, protocol="tcp")
    rows: list[dict[str, float]] = []
    async with MooncakeTransport.open(config) as sender, MooncakeTransport.open(config) as receiver:
        sender.register_buffer(src_addr, capacity)
        receiver.register_buffer(dst_addr, capacity)
        # Warm both paths: the first write to a peer performs the handshake.
        if raw_sender.transfer_sync_write(raw_peer, src_addr, dst_addr, 4096) != 0:
            raise RuntimeError(f"raw Mooncake warm-up write to {raw_peer} failed")
        warm = await sender.batch_write(receiver.session_id, [Op(src_addr, dst_addr, 4096)])
        if not warm.ok:
            raise RuntimeError(f"pdflow warm-up write failed: {warm.error}")

        async def memcpy(size: int) -> None:
            ctypes.memmove(dst_addr, src_addr, size)

        async def raw(size: int) -> None:
            status = raw_sender.transfer_sync_write(raw_peer, src_addr, dst_addr, size)
            if status != 0:
                raise RuntimeError(f"raw Mooncake write of {size} bytes failed ({status})")

        async def pdflow(size: int) -> None:
            outcome = await sender.batch_write(receiver.session_id, [Op(src_addr, dst_addr, size)])
            if not outcome.ok:
                raise RuntimeError(f"pdflow write of {size} bytes failed: {outcome.error}")

        paths: list[tuple[str, Callable[[int], Awaitable[None]]]] = [
            ("memcpy", memcpy),
            ("raw", raw),
            ("pdflow", pdflow),
        ]
        for size in sizes:
            timings: dict[str, list[float]] = {name: [] for name, _ in paths}
            for repeat in range(repeats):
                # Rotate the order so no path always runs right after another (cache, CPU).
                shift = repeat % len(paths)
                for name, write in paths[shift:] + paths[:shift]:
                    started = time.perf_counter()
                    await write(size)
                    timings[name].append(time.perf_counter() - started)
            medians = {name: statistics.median(values) for name, values in timings.items()}
            row = {
                "size_bytes": float(size),
                "memcpy_gbps": gbps(size, medians["memcpy"]),
                "raw_mooncake_gbps": gbps(size, medians["raw"]),
                "pdflow_gbps": gbps(size, medians["pdflow"]),
            }
            row["raw_vs_memcpy"] = row["raw_mooncake_gbps"] / row["memcpy_gbps"]
            row["pdflow_vs_raw"] = row["pdflow_gbps"] / row["raw_mooncake_gbps"]
            rows.append(row)
            progress(_format_row(row))
        if ctypes.string_at(dst_addr, max(sizes)) != ctypes.string_at(src_addr, max(sizes)):
            raise RuntimeError("destination differs from source after the benchmark writes")
    for engine, addr in ((raw_sender, src_addr), (raw_receiver, dst_addr)):
        engine.unregister_memory(addr)
    return rows


def _format_row(row: dict[str, float]) -> str:
    return (
        f"{int(row['size_bytes']) // MIB:>6} MiB  memcpy {row['memcpy_gbps']:6.2f} GB/s  "
        f"raw mooncake {row['raw_mooncake_gbps']:6.2f} GB/s  pdflow {row['pdflow_gbps']:6.2f} GB/s"
        f"  raw/memcpy {row['raw_vs_memcpy']:5.2f}  pdflow/raw {row['pdflow_vs_raw']:5.2f}"
    )


def run(
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    host: str = "127.0.0.1",
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every size and return {"benchmark", "host", "repeats", "results": [rows]}."""
    if not sizes or min(sizes) <= 0 or repeats < 1:
        raise ValueError(f"need positive sizes and repeats >= 1, got {sizes=} {repeats=}")
    progress(f"transport_raw: sizes {[s // MIB for s in sizes]} MiB, {repeats} repeats, {host}")
    rows = anyio.run(_measure, list(sizes), repeats, host, progress)
    return {"benchmark": "transport_raw", "host": host, "repeats": repeats, "results": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default=",".join(f"{s // MIB}M" for s in DEFAULT_SIZES),
        help="comma-separated sizes, e.g. 1M,64M,256M (default %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="median of this many (%(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    sizes = [parse_size(part) for part in args.sizes.split(",") if part.strip()]
    result = run(sizes, args.repeats, args.host)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
