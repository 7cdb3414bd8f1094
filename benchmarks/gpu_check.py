"""Triton staging kernels on a CUDA device vs that device's own copy bandwidth.

Shape: the hetero-TP benchmark's (32 layers, 4k tokens, page size 16, head_dim 128, bf16, 8 KV
heads on the decode, 2 per prefill rank). Prints GB/s of gather, scatter, page copy and checksum,
and each copy-like kernel as a fraction of ``torch`` copying the same number of bytes (target:
>= 80%). ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from kernels import triton_kernels

TARGET = 0.80


def _time(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of one call, CUDA-event timed, after warm-up (which also compiles)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return sorted(times)[len(times) // 2]


def run(*, tokens: int = 4096, layers: int = 32, iters: int = 20) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device; torch.cuda.is_available() is False")
    device = "cuda"
    page_size, heads, head_dim, prefill_heads = 16, 8, 128, 2
    pages = tokens // page_size
    prefill = [
        torch.randn(pages, page_size, prefill_heads, head_dim, device=device).to(torch.bfloat16)
        for _ in range(2 * layers)
    ]
    decode = [
        torch.zeros(pages, page_size, heads, head_dim, dtype=torch.bfloat16, device=device)
        for _ in range(2 * layers)
    ]
    src_pages = torch.arange(pages, device=device)
    dst_pages = torch.randperm(pages, device=device)
    cols = prefill_heads * head_dim
    staging = torch.empty(
        2 * layers * pages * page_size * cols, dtype=torch.bfloat16, device=device
    )
    copy_target = torch.empty_like(staging)
    region_bytes = staging.numel() * staging.element_size()

    copy_s = _time(lambda: copy_target.copy_(staging), iters)
    gather_s = _time(
        lambda: triton_kernels.gather_to_staging(prefill, src_pages, 0, cols, staging), iters
    )
    scatter_s = _time(
        lambda: triton_kernels.scatter_from_staging(staging, decode, dst_pages, cols, cols), iters
    )
    # Whole pages of the K buffers into the V buffers' shuffled pages (same shapes).
    page_copy_s = _time(
        lambda: triton_kernels.copy_pages(decode[:layers], decode[layers:], src_pages, dst_pages),
        iters,
    )
    page_bytes = layers * pages * page_size * heads * head_dim * 2
    checksum_s = _time(lambda: triton_kernels.checksum([staging]), max(3, iters // 4))

    def gbps(nbytes: int, seconds: float) -> float:
        return nbytes / seconds / 1e9

    copy_gbps = gbps(region_bytes, copy_s)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "region_bytes": region_bytes,
        "torch_copy_gbps": copy_gbps,
        "gather_gbps": gbps(region_bytes, gather_s),
        "scatter_gbps": gbps(region_bytes, scatter_s),
        "page_copy_gbps": gbps(page_bytes, page_copy_s),
        "checksum_gbps": gbps(region_bytes, checksum_s),
    }
    for name in ("gather", "scatter", "page_copy"):
        result[f"{name}_vs_copy"] = result[f"{name}_gbps"] / copy_gbps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = run()
    print(f"device: {result['device']}, staging region {result['region_bytes'] / 2**20:.0f} MiB")
    print(f"  torch copy (same bytes) {result['torch_copy_gbps']:8.1f} GB/s")
    for name in ("gather", "scatter", "page_copy"):
        share = result[f"{name}_vs_copy"]
        verdict = "ok" if share >= TARGET else f"BELOW the {TARGET:.0%} target"
        print(f"  {name:22s}  {result[f'{name}_gbps']:8.1f} GB/s  = {share:.0%} of copy  {verdict}")
    print(f"  checksum                {result['checksum_gbps']:8.1f} GB/s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
