"""The aux row's two routes, side by side on the control-plane batch (256 rooms of 4 KiB).

Each room carries its aux row (``--row-bytes``, 64 by default: a first token, a few logprobs, the
bootstrap room) from the prefill's aux buffer into the decode's aux slot, one of two ways:

* ``status``: pdflow's route. The prefill shell reads the row after the last chunk's KV writes
  and sends it on the Success report; the decode core hands it to its shell in the step that
  reports Success.
* ``write``: SGLang's route. One more transport write per room, from the prefill's row into the
  decode's registered aux buffer, in the last chunk's batch (a planner that appends it).

and ``kv_only`` moves no aux row: the baseline. The three run interleaved (``--repeats`` rounds)
through the same two nodes, ZMQ on loopback and Mooncake TCP, so drift hits all alike; reported:
each mode's median rooms/s and its ratio to ``kv_only``.

    python -m benchmarks.aux_route --rooms 256 --repeats 5
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio
import msgspec
import structlog

from benchmarks.common import write_json
from pdflow.core.dataplane.layout import AuxBuffer, KvDtype
from pdflow.core.dataplane.planning import WriteOp
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import KvArgs
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.io.kv_buffers import TransferPlanner, host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

GEOMETRY = {"num_layers": 2, "page_size": 16, "head_dim": 8, "total_kv_heads": 4}
MODES = ("kv_only", "status", "write")


class HostAux:
    def __init__(self, rows: int, row_bytes: int) -> None:
        self.memory = (ctypes.c_uint8 * (rows * row_bytes))()
        self.buffer = AuxBuffer.single(ctypes.addressof(self.memory), row_bytes, rows)


class AuxWritePlanner(TransferPlanner):
    """SGLang's route: the last chunk's writes end with the aux row's own write."""

    route: ClassVar[list[tuple[AuxBuffer, AuxBuffer] | None]] = [None]

    def plan(self, start: StartTransfer, peer: KvArgs) -> tuple[WriteOp, ...]:
        ops = super().plan(start, peer)
        buffers = self.route[0]
        if buffers is None or not start.is_last:
            return ops
        src, dst = buffers
        row = start.room % src.num_rows
        return (*ops, WriteOp(src.row_ranges(row)[0][0], dst.row_ranges(row)[0][0], src.row_bytes))


async def _measure(rooms: int, repeats: int, row_bytes: int,
                   progress: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    pages = rooms + 8
    settings = load_settings(env={}, trace_enabled=False)
    p_aux, d_aux = HostAux(pages, row_bytes), HostAux(pages, row_bytes)
    cache = {"num_pages": pages, "dtype": KvDtype.FP16, **GEOMETRY}
    # The caches own the memory: keep them referenced while the nodes run.
    p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **cache)  # type: ignore[arg-type]
    d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **cache)  # type: ignore[arg-type]
    p_kv = msgspec.structs.replace(p_kv, aux=p_aux.buffer)
    d_kv = msgspec.structs.replace(d_kv, aux=d_aux.buffer)
    p_transport, d_transport = MooncakeTransport.open(), MooncakeTransport.open()
    async with (
        p_transport, d_transport,
        PrefillNode(ranks=[p_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings, planner_factory=AuxWritePlanner) as p_node,
        DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings) as d_node,
    ):  # fmt: skip
        # The write route needs both aux buffers registered, as SGLang registers aux_data_ptrs.
        p_transport.register_buffer(p_aux.buffer.addrs[0], pages * row_bytes)
        d_transport.register_buffer(d_aux.buffer.addrs[0], pages * row_bytes)
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]

        async def room_pair(room: int, mode: str) -> None:
            row = room % pages
            status_route = mode == "status"

            async def prefill_side() -> None:
                await p_rank.open_room(room, 0)
                await p_rank.wait(room)
                await p_rank.init_transfer(room, 1, aux_index=row if status_route else None)
                await p_rank.send_chunk(room, [room % pages], True)
                await p_rank.wait(room, terminal=True)
                await p_rank.clear(room)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(prefill_side)
                await d_rank.open(room, 0, p_node.bootstrap)
                await d_rank.wait(room)
                await d_rank.admit(room, input_len=GEOMETRY["page_size"], max_new=0)
                await d_rank.publish_pages(room, [room % pages],
                                           aux_index=row if status_route else None)  # fmt: skip
                status = await d_rank.wait(room, terminal=True)
                if status.poll is not KVPoll.Success:
                    raise RuntimeError(f"room {room} ({mode}) failed: {status.reason}")
                await d_rank.clear(room)
                d_rank.finish_request(room, 0)

        async def batch(first: int, mode: str) -> float:
            AuxWritePlanner.route[0] = (p_aux.buffer, d_aux.buffer) if mode == "write" else None
            for row in range(pages):  # the engine's rows, distinct per room
                ctypes.memset(p_aux.buffer.row_ranges(row)[0][0], (first + row) % 251, row_bytes)
            ctypes.memset(d_aux.buffer.addrs[0], 0, pages * row_bytes)
            started = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for room in range(first, first + rooms):
                    tasks.start_soon(room_pair, room, mode)
            seconds = time.perf_counter() - started
            if mode != "kv_only":
                for room in range(first, first + rooms):
                    row = room % pages
                    landed = ctypes.string_at(d_aux.buffer.row_ranges(row)[0][0], row_bytes)
                    if landed != ctypes.string_at(p_aux.buffer.row_ranges(row)[0][0], row_bytes):
                        raise RuntimeError(f"{mode}: room {room}'s aux row did not land")
            return seconds

        await batch(0, "kv_only")  # warm-up: topology, connections
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        first = 10_000
        for repeat in range(repeats):
            for mode in MODES:
                seconds = await batch(first, mode)
                first += rooms
                rates[mode].append(rooms / seconds)
                progress(f"repeat {repeat} {mode}: {rooms / seconds:.0f} rooms/s")
    del p_cache, d_cache
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    return {
        "rooms": rooms,
        "row_bytes": row_bytes,
        "repeats": repeats,
        "rooms_per_s": rates,
        "median_rooms_per_s": medians,
        "ratio_to_kv_only": {mode: medians[mode] / medians["kv_only"] for mode in MODES},
    }


def run(rooms: int = 256, repeats: int = 5, row_bytes: int = 64,
        progress: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    result = anyio.run(_measure, rooms, repeats, row_bytes, progress, backend="asyncio")
    return {"benchmark": "aux_route", **result}


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--row-bytes", type=int, default=64)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    result = run(args.rooms, args.repeats, args.row_bytes)
    print({mode: round(ratio, 3) for mode, ratio in result["ratio_to_kv_only"].items()})
    if args.json:
        write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
