"""Heterogeneous-TP KV transfer over real Mooncake TCP: per-slice writes vs staging.

Prefill TP=4 -> decode TP=1 (by default 32 layers, 8 KV heads, head_dim 128, page size 16, 4k
tokens, bf16-sized elements), between two Mooncake TransferEngine instances talking TCP over
loopback in this process. Both paths run side by side in one run:

* **per-slice**: ``plan_head_slices`` ops (one write per buffer, page and token) submitted
  through ``MooncakeTransport.batch_write``. At the full shape that is about a million 512-byte
  writes, over a minute at the ~15k ops/s TCP manages here, so it is measured on the first
  ``--slice-layers`` layers only; its GB/s is the comparable figure.
* **staged**: ``plan_staged`` per prefill rank: gather into a staging region (data-plane
  executor), ONE bulk write into the decode's staging ring, then scatter. Measured on the full
  shape.

The decode memory both paths leave in the layers they both moved must be byte-identical
(checksummed with the executor), and the staged result is compared in full against a numpy
reference built straight from the prefill memory. Prefill ranks write one after another through
one sender engine (the receiver is the other engine).

    python -m benchmarks.hetero_tp_mooncake --slice-layers 2 --json out/hetero_mooncake.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from benchmarks.common import gbps, write_json
from pdflow.core.dataplane.checksum import ByteRange
from pdflow.core.dataplane.layout import (
    HeadRange,
    KvDtype,
    KvLayout,
    packed_layout,
    rank_head_range,
)
from pdflow.core.dataplane.planning import WriteOp, plan_head_slices, plan_staged, total_bytes
from pdflow.dataplane import Backend, Executor, make_executor
from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Shape:
    """The KV geometry moved from ``prefill_tp`` prefill ranks into one decode rank."""

    tokens: int = 4096
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    prefill_tp: int = 4

    @property
    def pages(self) -> int:
        return -(-self.tokens // self.page_size)

    def check(self) -> None:
        for name in ("tokens", "layers", "kv_heads", "head_dim", "page_size", "prefill_tp"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class RankKv:
    """One rank's KV cache: its heads, its (touched) host memory and the layout over it."""

    heads: HeadRange
    memory: np.ndarray
    layout: KvLayout

    @classmethod
    def allocate(cls, shape: Shape, heads: HeadRange) -> RankKv:
        nbytes = 2 * shape.layers * shape.pages * shape.page_size * heads.count
        memory = np.ones(nbytes * shape.head_dim * KvDtype.BF16.itemsize, dtype=np.uint8)
        layout = packed_layout(
            base_addr=memory.ctypes.data,
            num_layers=shape.layers,
            num_pages=shape.pages,
            page_size=shape.page_size,
            num_heads=heads.count,
            head_dim=shape.head_dim,
            dtype=KvDtype.BF16,
        )
        return cls(heads, memory, layout)

    def first_layers(self, count: int) -> KvLayout:
        """The same cache seen as if it had only its first ``count`` layers."""
        layout = self.layout
        return KvLayout(
            page_size=layout.page_size,
            num_heads=layout.num_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            num_pages=layout.num_pages,
            k_addrs=layout.k_addrs[:count],
            v_addrs=layout.v_addrs[:count],
        )

    def layer_ranges(self, count: int) -> list[ByteRange]:
        """K then V buffers of the first ``count`` layers, in canonical order."""
        sub = self.first_layers(count)
        return [(addr, sub.buffer_bytes) for addr in sub.buffer_addrs]

    def pages_view(self, shape: Shape) -> np.ndarray:
        """``[buffer, page, token, head, element]`` view, elements as 2-byte integers."""
        return self.memory.view(np.int16).reshape(
            2 * shape.layers, shape.pages, shape.page_size, self.heads.count, shape.head_dim
        )



def _expected_decode(
    shape: Shape, ranks: Sequence[RankKv], src_pages: Sequence[int], dst_pages: Sequence[int]
) -> np.ndarray:
    """What the decode cache must hold, built with numpy indexing (independent of the plans)."""
    expected = np.zeros(
        (2 * shape.layers, shape.pages, shape.page_size, shape.kv_heads, shape.head_dim),
        dtype=np.int16,
    )
    for rank in ranks:
        heads = slice(rank.heads.start, rank.heads.stop)
        expected[:, list(dst_pages), :, heads, :] = rank.pages_view(shape)[:, list(src_pages)]
    return expected


async def _write_checked(
    sender: MooncakeTransport, peer: str, ops: Sequence[WriteOp], what: str
) -> float:
    outcome = await sender.batch_write(peer, ops)
    if not outcome.ok:
        raise RuntimeError(f"{what}: Mooncake write failed: {outcome.error}")
    if outcome.nops != len(ops):
        raise RuntimeError(f"{what}: {outcome.nops} of {len(ops)} ops landed")
    return outcome.seconds or 0.0


async def _measure(
    shape: Shape, slice_layers: int, executor: Executor, seed: int, progress: Progress
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    src_pages = list(range(shape.pages))
    dst_pages = [int(page) for page in rng.permutation(shape.pages)]
    decode_heads = rank_head_range(shape.kv_heads, 1, 0)
    ranks = [
        RankKv.allocate(shape, rank_head_range(shape.kv_heads, shape.prefill_tp, rank))
        for rank in range(shape.prefill_tp)
    ]
    for rank in ranks:
        rank.memory[:] = np.frombuffer(rng.bytes(rank.memory.size), dtype=np.uint8)
    decode = RankKv.allocate(shape, decode_heads)
    payload = decode.memory.size
    region = payload // shape.prefill_tp
    prefill_staging = [np.ones(region, dtype=np.uint8) for _ in ranks]
    decode_ring = np.ones(payload, dtype=np.uint8)
    progress(
        f"hetero_tp_mooncake: {payload / 2**20:.0f} MiB of KV, TP {shape.prefill_tp}->1, "
        f"per-slice on {slice_layers} of {shape.layers} layers"
    )

    config = MooncakeConfig(host="127.0.0.1", protocol="tcp")
    async with MooncakeTransport.open(config) as sender, MooncakeTransport.open(config) as receiver:
        for memory in [rank.memory for rank in ranks] + prefill_staging:
            sender.register_buffer(memory.ctypes.data, memory.size)
        for memory in (decode.memory, decode_ring):
            receiver.register_buffer(memory.ctypes.data, memory.size)
        peer = receiver.session_id
        # The first write to a peer performs the handshake; neither path should pay for it.
        warm = WriteOp(ranks[0].memory.ctypes.data, decode_ring.ctypes.data, 4096)
        await _write_checked(sender, peer, [warm], "warm-up")

        # -- per-slice, on the first slice_layers layers ----------------------------------------
        decode.memory.fill(0)
        slice_plans = [
            plan_head_slices(
                rank.first_layers(slice_layers),
                decode.first_layers(slice_layers),
                rank.heads,
                decode_heads,
                src_pages,
                dst_pages,
            )
            for rank in ranks
        ]
        slice_ops = sum(len(ops) for ops in slice_plans)
        slice_bytes = sum(total_bytes(ops) for ops in slice_plans)
        progress(f"  per-slice: {slice_ops} writes of {slice_plans[0][0].length} bytes")
        started = time.perf_counter()
        for index, ops in enumerate(slice_plans):
            await _write_checked(sender, peer, ops, f"per-slice rank {index}")
        slice_s = time.perf_counter() - started
        compared_ranges = decode.layer_ranges(slice_layers)
        slice_checksum = executor.checksum(compared_ranges)
        ops_per_layer, remainder = divmod(slice_ops, slice_layers)
        if remainder:
            raise RuntimeError(f"per-slice plan has {slice_ops} ops, uneven over layers")
        del slice_plans

        # -- staged, on the full shape ----------------------------------------------------------
        decode.memory.fill(0)
        staged_plans = [
            plan_staged(
                rank.layout,
                decode.layout,
                rank.heads,
                decode_heads,
                src_pages,
                dst_pages,
                src_staging_addr=staging.ctypes.data,
                dst_staging_addr=decode_ring.ctypes.data + index * region,
            )
            for index, (rank, staging) in enumerate(zip(ranks, prefill_staging, strict=True))
        ]
        progress(f"  staged: {len(staged_plans)} writes of {staged_plans[0].write.length} bytes")
        write_s = 0.0
        started = time.perf_counter()
        for index, plan in enumerate(staged_plans):
            executor.gather(plan.gather)
            write_s += await _write_checked(sender, peer, [plan.write], f"staged rank {index}")
        for plan in staged_plans:
            executor.scatter(plan.scatter)
        staged_s = time.perf_counter() - started
        staged_checksum = executor.checksum(compared_ranges)

    if staged_checksum != slice_checksum:
        raise RuntimeError(
            f"staged and per-slice paths left different decode KV in the first {slice_layers} "
            f"layers ({staged_checksum.hex} vs {slice_checksum.hex})"
        )
    expected = _expected_decode(shape, ranks, src_pages, dst_pages)
    if not np.array_equal(decode.pages_view(shape), expected):
        raise RuntimeError("staged path left decode KV that differs from the numpy reference")

    slice_gbps = gbps(slice_bytes, slice_s)
    staged_gbps = gbps(payload, staged_s)
    return {
        "benchmark": "hetero_tp_mooncake",
        "transport": "mooncake tcp, loopback, two engines in one process",
        "shape": {
            "tokens": shape.tokens,
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "page_size": shape.page_size,
            "prefill_tp": shape.prefill_tp,
            "decode_tp": 1,
            "dtype": "bf16",
        },
        "backend": executor.backend.value,
        "payload_bytes": payload,
        "per_slice": {
            "measured_layers": slice_layers,
            "note": f"measured on {slice_layers} of {shape.layers} layers; compare GB/s",
            "measured_ops": slice_ops,
            "measured_bytes": slice_bytes,
            "slice_bytes": slice_bytes // slice_ops,
            "seconds": slice_s,
            "gbps": slice_gbps,
            "ops_per_second": slice_ops / slice_s,
            "full_shape_ops": ops_per_layer * shape.layers,
            "full_shape_seconds_projected": payload / (slice_gbps * 1e9),
        },
        "staged": {
            "measured_layers": shape.layers,
            "ops": len(staged_plans),
            "write_bytes": staged_plans[0].write.length,
            "seconds": staged_s,
            "gbps": staged_gbps,
            "write_seconds": write_s,
            "write_gbps": gbps(payload, write_s),
        },
        "staged_over_per_slice": staged_gbps / slice_gbps,
        "checksum_compared_layers": slice_layers,
        "checksum": staged_checksum.hex,
        "staged_matches_reference": True,
    }


def run(
    *,
    tokens: int = 4096,
    layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    prefill_tp: int = 4,
    slice_layers: int = 2,
    backend: Backend = Backend.NUMPY,
    seed: int = 0,
    progress: Progress = print,
) -> dict[str, Any]:
    """Measure both paths over Mooncake TCP and return the figures (see the module docstring)."""
    shape = Shape(tokens, layers, kv_heads, head_dim, page_size, prefill_tp)
    shape.check()
    if not 1 <= slice_layers <= layers:
        raise ValueError(f"slice_layers must lie in [1, layers={layers}], got {slice_layers}")
    executor = make_executor("cpu", backend)
    result: dict[str, Any] = anyio.run(_measure, shape, slice_layers, executor, seed, progress)
    return result


def format_result(result: dict[str, Any]) -> str:
    """Human-readable lines for a ``run`` result."""
    per_slice, staged = result["per_slice"], result["staged"]
    return "\n".join(
        [
            f"hetero TP {result['shape']['prefill_tp']}->1 over Mooncake TCP, "
            f"{result['payload_bytes'] / 2**20:.0f} MiB of KV, backend {result['backend']}",
            f"  per-slice {per_slice['measured_ops']:>8d} ops  {per_slice['seconds']:7.3f} s  "
            f"{per_slice['gbps']:7.4f} GB/s  ({per_slice['ops_per_second']:,.0f} ops/s; "
            f"{per_slice['note']}; {per_slice['full_shape_ops']:,} ops at full shape)",
            f"  staged    {staged['ops']:>8d} ops  {staged['seconds']:7.3f} s  "
            f"{staged['gbps']:7.4f} GB/s  (bulk writes alone {staged['write_gbps']:.2f} GB/s)",
            f"  staged / per-slice GB/s: {result['staged_over_per_slice']:.1f}x; decode KV "
            f"identical on the {result['checksum_compared_layers']} shared layers "
            f"(checksum {result['checksum']}), staged equals the reference",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-tp", type=int, default=4)
    parser.add_argument(
        "--slice-layers", type=int, default=2, help="layers the per-slice path moves (%(default)s)"
    )
    parser.add_argument("--backend", choices=[b.value for b in Backend], default="numpy")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    result = run(
        tokens=args.tokens,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        prefill_tp=args.prefill_tp,
        slice_layers=args.slice_layers,
        backend=Backend(args.backend),
    )
    print(format_result(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
