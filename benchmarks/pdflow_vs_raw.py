"""One big room through pdflow against the raw Mooncake engine moving the same bytes.

A prefill node and a decode node (TP=1 each, both in this process, Mooncake TCP on loopback)
move one room of ``size`` bytes of KV; the time runs from the prefill's last ``send_chunk`` to
the decode's Success, so it includes planning, the transfer queue and the status message. The
raw path writes the very same ops (planned once by pdflow), between two other engines
registered on the same memory, with each of the engine's own synchronous calls: one
``transfer_sync_write`` per op, one after another, and one ``batch_transfer_sync_write`` of
all of them (what SGLang's Mooncake manager calls). The faster of the two medians is the
baseline: one op at a time understated the engine at 1 MiB by 20-30% (4 ops of 256 KiB
0.59-0.73 ms, the batch call 0.48-0.51 ms, 2026-12-02), while at 16-64 MiB either can be
the faster. Each raw time runs inside the thread that makes the call (no hop to or from the
event loop), pdflow's from the loop's ``send_chunk`` to its waiter. Repeats are interleaved
and each figure is the median. As under `pdflow bench`, structlog output below WARNING is off
(``--log`` keeps it): rendered by structlog's default console renderer, the two room_finished
lines of each room (one per node, both on this one loop) cost about 0.3 ms each here, which at
1 MiB is most of the raw engine's whole write.

    python benchmarks/pdflow_vs_raw.py --size-mib 64 --repeats 5

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
import anyio.to_thread
import structlog

from benchmarks.common import raw_engine
from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.io.kv_buffers import TransferPlanner, host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

MIB = 1 << 20
# A page is 16 tokens x 8 heads x 128 dims x fp16 = 32 KiB per buffer; 2 layers = 4 buffers.
GEOMETRY = {"num_layers": 2, "page_size": 16, "head_dim": 128, "total_kv_heads": 8}
PAGE_BYTES = 4 * 32 * 1024


async def _measure(size: int, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    pages = size // PAGE_BYTES
    settings = load_settings(env={}, trace_dir=tempfile.mkdtemp())
    src_cache, src_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=pages,
                                            dtype=KvDtype.FP16, **GEOMETRY)  # fmt: skip
    dst_cache, dst_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=pages,
                                            dtype=KvDtype.FP16, **GEOMETRY)  # fmt: skip
    raw_src, raw_dst = raw_engine("127.0.0.1"), raw_engine("127.0.0.1")
    for engine, cache in ((raw_src, src_cache), (raw_dst, dst_cache)):
        if engine.register_memory(cache.base_addr, cache.nbytes) != 0:
            raise RuntimeError("Mooncake refused to register the benchmark buffers")
    raw_peer = f"127.0.0.1:{raw_dst.get_rpc_port()}"
    all_pages = tuple(range(pages))
    p_transport, d_transport = MooncakeTransport.open(), MooncakeTransport.open()
    timings: dict[str, list[float]] = {"pdflow": [], "raw_per_op": [], "raw_batch": []}
    async with (
        p_transport, d_transport,
        PrefillNode(ranks=[src_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings) as p_node,
        DecodeNode(ranks=[dst_kv], transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        args = dst_kv.kv_args(d_rank.peer, p_rank.peer, raw_peer)
        start = StartTransfer(0, 0, 0, d_rank.peer, raw_peer, all_pages, all_pages, True, None,
                              None)  # fmt: skip
        ops = TransferPlanner(src_kv).plan(start, args)

        async def through_pdflow(room: int) -> float:
            await p_rank.open_room(room, 0)
            await d_rank.open(room, 0, p_node.bootstrap)
            await d_rank.wait(room)
            await d_rank.admit(room, input_len=pages * dst_kv.layout.page_size, max_new=0)
            await d_rank.publish_pages(room, all_pages)
            await p_rank.wait(room)
            await p_rank.init_transfer(room, pages)
            started = time.perf_counter()
            await p_rank.send_chunk(room, all_pages, True)
            status = await d_rank.wait(room, terminal=True)
            seconds = time.perf_counter() - started
            if status.poll is not KVPoll.Success:
                raise RuntimeError(f"pdflow room failed: {status.reason}")
            await d_rank.clear(room)
            d_rank.finish_request(room, 0)
            await p_rank.wait(room, terminal=True)
            await p_rank.clear(room)
            return seconds

        srcs, dsts = [op.src_addr for op in ops], [op.dst_addr for op in ops]
        lengths = [op.length for op in ops]

        def raw_per_op() -> float:
            started = time.perf_counter()
            for op in ops:
                if raw_src.transfer_sync_write(raw_peer, op.src_addr, op.dst_addr, op.length):
                    raise RuntimeError(f"raw Mooncake write of {op.length} bytes failed")
            return time.perf_counter() - started

        def raw_batch() -> float:
            started = time.perf_counter()
            if raw_src.batch_transfer_sync_write(raw_peer, srcs, dsts, lengths):
                raise RuntimeError(f"raw Mooncake batch write of {len(ops)} ops failed")
            return time.perf_counter() - started

        raw_calls = {"raw_per_op": raw_per_op, "raw_batch": raw_batch}
        await through_pdflow(0)  # warm-up: topology, connections, handshakes
        for call in raw_calls.values():
            call()
        names = ["pdflow", *raw_calls]
        for repeat in range(repeats):
            # Each side goes first, middle and last in turn: none always follows the other.
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                if name == "pdflow":
                    timings[name].append(await through_pdflow(repeat + 1))
                else:
                    timings[name].append(await anyio.to_thread.run_sync(raw_calls[name]))
    for engine, cache in ((raw_src, src_cache), (raw_dst, dst_cache)):
        engine.unregister_memory(cache.base_addr)
    moved = pages * PAGE_BYTES
    result = {
        "bytes": moved,
        "ops": len(ops),
        "repeats": repeats,
        "pdflow_gbps": moved / statistics.median(timings["pdflow"]) / 1e9,
        "raw_per_op_gbps": moved / statistics.median(timings["raw_per_op"]) / 1e9,
        "raw_batch_gbps": moved / statistics.median(timings["raw_batch"]) / 1e9,
    }
    result["raw_mooncake_gbps"] = max(result["raw_per_op_gbps"], result["raw_batch_gbps"])
    result["pdflow_vs_raw"] = result["pdflow_gbps"] / result["raw_mooncake_gbps"]
    progress(f"pdflow_vs_raw: {moved // MIB} MiB in {len(ops)} ops: pdflow "
             f"{result['pdflow_gbps']:.2f} GB/s, raw Mooncake {result['raw_mooncake_gbps']:.2f} "
             f"GB/s (per op {result['raw_per_op_gbps']:.2f}, batch call "
             f"{result['raw_batch_gbps']:.2f}), ratio {result['pdflow_vs_raw']:.2f}")  # fmt: skip
    return result


def run(size: int = 64 * MIB, repeats: int = 5,
        progress: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Measure once; returns {"benchmark", "bytes", "pdflow_gbps", "raw_mooncake_gbps", ...}."""
    if size < PAGE_BYTES or repeats < 1:
        raise ValueError(f"need size >= {PAGE_BYTES} bytes and repeats >= 1")
    result = anyio.run(_measure, size, repeats, progress, backend="asyncio")
    return {"benchmark": "pdflow_vs_raw", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument(
        "--log", action="store_true", help="keep structlog's info lines (pdflow bench has none)"
    )
    args = parser.parse_args()
    if not args.log:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = run(args.size_mib * MIB, args.repeats)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
