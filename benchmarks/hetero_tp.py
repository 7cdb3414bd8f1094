"""Heterogeneous-TP KV transfer: per-slice writes vs staging (gather, one bulk write, scatter).

Both paths move the same KV bytes from every prefill rank into one decode rank, side by side in
one run, through an injected ``write_ops`` callable (default: an in-process memcpy of each op);
a transport benchmark injects its own. The decode memory of both paths is checksummed and must
match. Run ``python -m benchmarks.hetero_tp --json out.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.common import gbps
from pdflow.core.dataplane.layout import KvDtype, KvLayout, packed_layout, rank_head_range
from pdflow.core.dataplane.planning import WriteOp, plan_head_slices, plan_staged
from pdflow.dataplane import Backend, make_executor, memmove_write_ops

WriteOps = Callable[[Sequence[WriteOp]], None]


def _touched(nbytes: int) -> np.ndarray:
    """Memory already faulted in, so no path pays the first-touch cost of another."""
    memory = np.empty(nbytes, dtype=np.uint8)
    memory.fill(1)
    return memory


def _rank_memory(layers: int, pages: int, page_size: int, heads: int, head_dim: int) -> np.ndarray:
    # bf16 KV stored as int16: only the bytes matter here.
    return _touched(2 * layers * pages * page_size * heads * head_dim * 2).view(np.int16)


def _layout(
    memory: np.ndarray, layers: int, pages: int, page_size: int, heads: int, head_dim: int
) -> KvLayout:
    return packed_layout(
        base_addr=memory.ctypes.data,
        num_layers=layers,
        num_pages=pages,
        page_size=page_size,
        num_heads=heads,
        head_dim=head_dim,
        dtype=KvDtype.BF16,
    )



def run(
    *,
    tokens: int = 4096,
    layers: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    prefill_tp: int = 4,
    backend: Backend = Backend.NUMPY,
    write_ops: WriteOps = memmove_write_ops,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure both paths for prefill TP=``prefill_tp`` -> decode TP=1; returns the figures."""
    pages = -(-tokens // page_size)
    rng = np.random.default_rng(seed)
    src_pages = list(range(pages))
    dst_pages = [int(p) for p in rng.permutation(pages)]
    dst_heads = rank_head_range(kv_heads, 1, 0)
    executor = make_executor("cpu", backend)

    ranks = []
    for rank in range(prefill_tp):
        heads = rank_head_range(kv_heads, prefill_tp, rank)
        memory = _rank_memory(layers, pages, page_size, heads.count, head_dim)
        memory[:] = rng.integers(-(2**15), 2**15, memory.size, dtype=np.int16)
        ranks.append(
            (heads, memory, _layout(memory, layers, pages, page_size, heads.count, head_dim))
        )
    decode = _rank_memory(layers, pages, page_size, kv_heads, head_dim)
    dst_layout = _layout(decode, layers, pages, page_size, kv_heads, head_dim)
    payload = decode.nbytes
    decode.fill(0)

    started = time.perf_counter()
    slice_plans = [
        plan_head_slices(layout, dst_layout, heads, dst_heads, src_pages, dst_pages)
        for heads, _, layout in ranks
    ]
    slice_plan_s = time.perf_counter() - started
    started = time.perf_counter()
    for ops in slice_plans:
        write_ops(ops)
    slice_s = time.perf_counter() - started
    slice_ops = sum(len(ops) for ops in slice_plans)
    slice_checksum = executor.checksum([(decode.ctypes.data, decode.nbytes)])
    del slice_plans

    decode[:] = 0
    region = payload // prefill_tp
    prefill_staging = [_touched(region) for _ in ranks]
    ring = _touched(payload)
    started = time.perf_counter()
    staged_plans = [
        plan_staged(
            layout,
            dst_layout,
            heads,
            dst_heads,
            src_pages,
            dst_pages,
            src_staging_addr=staging.ctypes.data,
            dst_staging_addr=ring.ctypes.data + index * region,
        )
        for index, ((heads, _, layout), staging) in enumerate(
            zip(ranks, prefill_staging, strict=True)
        )
    ]
    staged_plan_s = time.perf_counter() - started
    started = time.perf_counter()
    for plan in staged_plans:
        executor.gather(plan.gather)
        write_ops([plan.write])
    for plan in staged_plans:
        executor.scatter(plan.scatter)
    staged_s = time.perf_counter() - started
    staged_checksum = executor.checksum([(decode.ctypes.data, decode.nbytes)])
    if staged_checksum != slice_checksum:
        raise RuntimeError(
            f"staged and per-slice paths left different decode KV ({staged_checksum.hex} vs "
            f"{slice_checksum.hex}); the staging layout of gather and scatter disagree"
        )

    copy_target = _touched(payload).view(np.int16)
    started = time.perf_counter()
    np.copyto(copy_target, decode)
    memcpy_s = time.perf_counter() - started

    return {
        "shape": {
            "tokens": tokens,
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "page_size": page_size,
            "prefill_tp": prefill_tp,
            "decode_tp": 1,
            "dtype": "bf16",
        },
        "backend": executor.backend.value,
        "payload_bytes": payload,
        "per_slice": {
            "ops": slice_ops,
            "seconds": slice_s,
            "gbps": gbps(payload, slice_s),
            "plan_seconds": slice_plan_s,
        },
        "staged": {
            "ops": len(staged_plans),
            "seconds": staged_s,
            "gbps": gbps(payload, staged_s),
            "plan_seconds": staged_plan_s,
        },
        "memcpy_gbps": gbps(payload, memcpy_s),
        "staged_over_per_slice": slice_s / staged_s,
        "checksum": staged_checksum.hex,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefill-tp", type=int, default=4)
    # numpy measured fastest for host memory here (torch's index copy is ~1.6x slower).
    parser.add_argument("--backend", choices=[b.value for b in Backend], default="numpy")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    result = run(
        tokens=args.tokens,
        layers=args.layers,
        prefill_tp=args.prefill_tp,
        backend=Backend(args.backend),
    )
    mib = result["payload_bytes"] / 2**20
    print(f"hetero TP {args.prefill_tp}->1, {mib:.0f} MiB of KV, backend {result['backend']}")
    for name in ("per_slice", "staged"):
        path = result[name]
        print(
            f"  {name:9s} {path['ops']:>9d} ops  {path['seconds']:8.3f} s  "
            f"{path['gbps']:7.2f} GB/s  (planning {path['plan_seconds']:.3f} s)"
        )
    print(f"  memcpy of the same bytes: {result['memcpy_gbps']:.2f} GB/s")
    print(f"  staged / per-slice speed: {result['staged_over_per_slice']:.1f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
