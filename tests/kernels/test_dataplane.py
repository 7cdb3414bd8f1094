"""Executors run real staging plans on real memory; fallbacks work without torch or triton."""

import subprocess
import sys
import textwrap
from types import ModuleType

import pytest
import torch

from pdflow import dataplane
from pdflow.core.dataplane.checksum import checksum_bytes
from pdflow.core.dataplane.layout import KvDtype, packed_layout, rank_head_range
from pdflow.core.dataplane.planning import plan_head_slices, plan_pages, plan_staged
from pdflow.dataplane import Backend, available_backends, make_executor
from pdflow.dataplane import backend as backend_module

LAYERS, PAGES, PAGE_SIZE, TOTAL_HEADS, HEAD_DIM = 2, 6, 4, 8, 16
PREFILL_TP = 4


def kv_memory(heads: int, device: str, seed: int) -> tuple[torch.Tensor, object]:
    """Random KV bytes for one rank plus the layout describing them (bf16, packed buffers)."""
    nbytes = 2 * LAYERS * PAGES * PAGE_SIZE * heads * HEAD_DIM * 2
    gen = torch.Generator().manual_seed(seed)
    memory = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
    layout = packed_layout(
        base_addr=memory.data_ptr(),
        num_layers=LAYERS,
        num_pages=PAGES,
        page_size=PAGE_SIZE,
        num_heads=heads,
        head_dim=HEAD_DIM,
        dtype=KvDtype.BF16,
    )
    return memory, layout


def as_kv(memory: torch.Tensor, heads: int) -> torch.Tensor:
    return memory.view(torch.int16).view(2 * LAYERS, PAGES, PAGE_SIZE, heads, HEAD_DIM)


def executors(device: str) -> list[Backend]:
    return available_backends(device)


@pytest.mark.parametrize("rank", [0, 3])
def test_every_backend_executes_the_staged_plan(rank: int, device: str) -> None:
    src_heads = rank_head_range(TOTAL_HEADS, PREFILL_TP, rank)
    dst_heads = rank_head_range(TOTAL_HEADS, 1, 0)
    src_pages, dst_pages = [4, 0, 1], [2, 3, 5]
    src_mem, src = kv_memory(src_heads.count, device, seed=rank)
    backends = executors(device)
    assert backends, "this device has no backend"
    for chosen in backends:
        dst_mem, dst = kv_memory(dst_heads.count, device, seed=100 + rank)
        before = as_kv(dst_mem, dst_heads.count).clone()
        region = torch.zeros(
            2 * LAYERS * 3 * PAGE_SIZE * src_heads.count * HEAD_DIM * 2,
            dtype=torch.uint8,
            device=device,
        )
        ring = torch.zeros_like(region)
        plan = plan_staged(
            src,
            dst,
            src_heads,
            dst_heads,
            src_pages,
            dst_pages,
            src_staging_addr=region.data_ptr(),
            dst_staging_addr=ring.data_ptr(),
        )
        executor = make_executor(device, chosen)
        executor.gather(plan.gather)
        executor.write([plan.write])
        executor.scatter(plan.scatter)

        got = as_kv(dst_mem, dst_heads.count)
        expected = before.clone()
        expected[:, dst_pages, :, src_heads.start : src_heads.stop] = as_kv(
            src_mem, src_heads.count
        )[:, src_pages]
        assert torch.equal(got, expected), chosen

        sent = executor.checksum(list(plan.gather.buffer_ranges()))
        received = executor.checksum(list(plan.scatter.buffer_ranges()))
        assert sent == received
        slices = plan_head_slices(src, dst, src_heads, dst_heads, src_pages, dst_pages)
        raw = b"".join(
            bytes(src_mem[op.src_addr - src_mem.data_ptr() :][: op.length].cpu().numpy())
            for op in slices
        )
        assert sent == checksum_bytes(raw)


def test_every_backend_writes_page_plans(device: str) -> None:
    src_mem, src = kv_memory(2, device, seed=5)
    for chosen in executors(device):
        dst_mem, dst = kv_memory(2, device, seed=6)
        expected = as_kv(dst_mem, 2).clone()
        expected[:, [3, 4, 0]] = as_kv(src_mem, 2)[:, [1, 2, 5]]
        make_executor(device, chosen).write(plan_pages(src, dst, [1, 2, 5], [3, 4, 0]))
        assert torch.equal(as_kv(dst_mem, 2), expected), chosen


def hide(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real = backend_module.load_optional

    def load(name: str) -> ModuleType | None:
        return None if name in missing else real(name)

    monkeypatch.setattr(backend_module, "load_optional", load)


def test_falls_back_to_numpy_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "torch", "triton")
    assert available_backends("cpu") == [Backend.NUMPY, Backend.PYTHON]
    assert make_executor("cpu").backend is Backend.NUMPY
    assert available_backends("cuda") == []
    with pytest.raises(RuntimeError, match="install the 'kernels' extra"):
        make_executor("cuda")


def test_falls_back_to_python_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    hide(monkeypatch, "torch", "triton", "numpy")
    assert make_executor("cpu").backend is Backend.PYTHON
    with pytest.raises(RuntimeError, match="cannot run"):
        make_executor("cpu", Backend.TORCH)


def test_package_imports_and_works_with_no_optional_packages() -> None:
    script = textwrap.dedent(
        """
        import sys
        for name in ("torch", "triton", "numpy"):
            sys.modules[name] = None  # makes any import of it raise ImportError
        import ctypes
        import pdflow
        from pdflow.core.dataplane.layout import KvDtype, packed_layout
        from pdflow.core.dataplane.planning import plan_staged
        from pdflow.core.dataplane.layout import HeadRange
        from pdflow.dataplane import make_executor
        ex = make_executor()
        assert ex.backend.value == "python", ex.backend
        size = 2 * 4 * 2 * 2
        src_buf = ctypes.create_string_buffer(bytes(range(size)))
        dst_buf = ctypes.create_string_buffer(2 * size)
        stage = ctypes.create_string_buffer(size // 2)
        ring = ctypes.create_string_buffer(size // 2)
        def lay(addr, heads):
            return packed_layout(base_addr=addr, num_layers=1, num_pages=2, page_size=2,
                                 num_heads=heads, head_dim=2, dtype=KvDtype.INT8)
        plan = plan_staged(lay(ctypes.addressof(src_buf), 2), lay(ctypes.addressof(dst_buf), 4),
                           HeadRange(2, 2), HeadRange(0, 4), [1], [0],
                           src_staging_addr=ctypes.addressof(stage),
                           dst_staging_addr=ctypes.addressof(ring))
        ex.gather(plan.gather); ex.write([plan.write]); ex.scatter(plan.scatter)
        # K buffer, decode page 0, token 0, heads 2-3 = prefill page 1 token 0 bytes 8..11.
        assert dst_buf.raw[4:8] == bytes([8, 9, 10, 11]), dst_buf.raw
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert dataplane.Backend.PYTHON.value == "python"
