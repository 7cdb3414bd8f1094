"""Control-plane throughput: many small rooms through a prefill node and a decode node.

Both nodes run in this process but talk as in production: ZMQ on loopback for control, the
bootstrap registry over HTTP, Mooncake TCP for the KV. Each room moves ``room_bytes`` of KV per
prefill rank. Reported: rooms per second over the whole batch, and the handshake latency of each
room (decode open -> decode Success: topology, metadata, write, status) as p50/p99. Each room
is driven by one task that makes the prefill's and the decode's calls in order, as an engine
runs one task per request.

    python -m benchmarks.control_plane --rooms 256

`run(...)` returns the figures as a dict, for `pdflow bench`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import structlog

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode, DecodeRank
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

# One page per room per rank: 2 layers x (K, V) x 16 tokens x 4 heads x 8 dims x fp16 = 4 KiB.
GEOMETRY = {"num_layers": 2, "page_size": 16, "head_dim": 8, "total_kv_heads": 4}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(rooms: int, trace: bool, progress: Callable[[str], None],
                   batches: int = 1) -> dict[str, Any]:  # fmt: skip
    pages = rooms + 8
    settings = load_settings(env={}, trace_enabled=trace, trace_dir=tempfile.mkdtemp())
    prefill = [host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=pages, dtype=KvDtype.FP16,
                                   **GEOMETRY)]  # fmt: skip
    decode = [host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=pages, dtype=KvDtype.FP16,
                                  **GEOMETRY)]  # fmt: skip
    room_bytes = prefill[0][1].layout.item_len * 2 * GEOMETRY["num_layers"]
    p_transport, d_transport = MooncakeTransport.open(), MooncakeTransport.open()
    async with (
        p_transport, d_transport,
        PrefillNode(ranks=[prefill[0][1]], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings) as p_node,
        DecodeNode(ranks=[decode[0][1]], transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        latencies: list[float] = []

        async def room_flow(room: int, rank: DecodeRank) -> None:
            # One task per room, as an engine runs one per request: a second task per room
            # (one per side) doubled the harness's share of what each full GC pass walks, and
            # at 16,000 rooms that share was most of the heap (benchmarks/README.md).
            await p_rank.open_room(room, 0)
            started = time.perf_counter()
            await rank.open(room, 0, p_node.bootstrap)
            await rank.wait(room)
            await rank.admit(room, input_len=GEOMETRY["page_size"], max_new=0)
            await rank.publish_pages(room, [room % pages])
            await p_rank.wait(room)
            await p_rank.init_transfer(room, 1)
            await p_rank.send_chunk(room, [room % pages], True)
            status = await rank.wait(room, terminal=True)
            if status.poll is not KVPoll.Success:
                raise RuntimeError(f"room {room} failed: {status.reason}")
            latencies.append(time.perf_counter() - started)
            await rank.clear(room)
            rank.finish_request(room, 0)
            await p_rank.wait(room, terminal=True)
            await p_rank.clear(room)

        async def batch(first: int, count: int) -> float:
            started = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for room in range(first, first + count):
                    tasks.start_soon(room_flow, room, d_rank)
            return time.perf_counter() - started

        await batch(0, 8)  # warm-up: topology fetch, connections
        for extra in range(1, batches):  # more of the same load, for a profiler to sample
            await batch(1000 + extra * rooms, rooms)
        latencies.clear()
        seconds = await batch(1000, rooms)
    result = {
        "rooms": rooms,
        "room_bytes": room_bytes,
        "trace": trace,
        "seconds": seconds,
        "rooms_per_s": rooms / seconds,
        "handshake_p50_ms": 1000 * statistics.median(latencies),
        "handshake_p99_ms": 1000 * _percentile(latencies, 0.99),
    }
    progress(
        f"control_plane: {rooms} rooms of {room_bytes} B in {seconds:.3f} s = "
        f"{result['rooms_per_s']:.0f} rooms/s, handshake p50 "
        f"{result['handshake_p50_ms']:.1f} ms p99 {result['handshake_p99_ms']:.1f} ms"
    )
    return result


def run(rooms: int = 256, trace: bool = True, progress: Callable[[str], None] = print,
        batches: int = 1) -> dict[str, Any]:  # fmt: skip
    """Run the batch and return {"benchmark", "rooms", "rooms_per_s", "handshake_*_ms"}; with
    ``batches`` > 1 the same load runs that many times first (the last one is measured)."""
    if rooms < 1 or batches < 1:
        raise ValueError(f"rooms and batches must be >= 1, got {rooms} and {batches}")
    result = anyio.run(_measure, rooms, trace, progress, batches, backend="asyncio")
    return {"benchmark": "control_plane", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=256)
    parser.add_argument("--no-trace", action="store_true", help="switch the trace recorder off")
    parser.add_argument("--batches", type=int, default=1,
                        help="run the load this many times (for a profiler; the last is timed)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--log", action="store_true",
                        help="keep structlog's info lines (pdflow bench silences them too)")
    args = parser.parse_args()
    if not args.log:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = run(args.rooms, trace=not args.no_trace, batches=args.batches)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
