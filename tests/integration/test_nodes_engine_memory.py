"""An engine hands pdflow its own memory: staging regions it allocated (torch tensors here) on
both sides of a heterogeneous-TP transfer, and the device its buffers live on picks the
executor."""

from __future__ import annotations

import ctypes
from typing import Any

import anyio
import msgspec
import pytest
import torch

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.dataplane.backend import Backend
from pdflow.io.kv_buffers import EngineMemory, executor_for, host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL = {"total_kv_heads": 4, "num_layers": 2, "page_size": 4, "head_dim": 8,
         "dtype": KvDtype.FP16, "num_pages": 16}  # fmt: skip


async def staged_room() -> dict[str, Any]:
    settings = load_settings(trace_enabled=False, checksum=True)
    fabric = InProcessFabric()
    prefill = [host_cache_for_rank(tp_size=2, tp_rank=r, **MODEL) for r in range(2)]  # type: ignore[arg-type]
    decode_cache, decode_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    for rank, (cache, _) in enumerate(prefill):
        ctypes.memset(cache.base_addr, 0x21 + rank, cache.nbytes)
    page_bytes = 2 * MODEL["num_layers"] * decode_kv.layout.item_len  # type: ignore[operator]
    # The engine's own staging memory: uint8 tensors it allocated (device memory in production).
    p_staging = torch.zeros(4 * 8 * page_bytes, dtype=torch.uint8)  # 4 queues x 8 pages
    d_staging = torch.zeros(16 * page_bytes, dtype=torch.uint8)
    async with (
        fabric.create_transport() as p_transport,
        fabric.create_transport() as d_transport,
        PrefillNode(ranks=[kv for _, kv in prefill], transport=p_transport,
                    bootstrap="127.0.0.1:0", settings=settings, transfer_lanes=1,
                    staging_slot_bytes=8 * page_bytes,
                    staging_memory=EngineMemory.of_tensor(p_staging)) as p_node,
        DecodeNode(ranks=[decode_kv], transport=d_transport, settings=settings,
                   staging_bytes=16 * page_bytes,
                   staging_memory={0: EngineMemory.of_tensor(d_staging)}) as d_node,
    ):  # fmt: skip
        for rank in p_node.ranks:
            await rank.open_room(1, 0)
        d_rank = d_node.ranks[0]
        await d_rank.open(1, 0, p_node.bootstrap)
        await d_rank.wait(1)
        await d_rank.publish_pages(1, [3, 4])
        for rank in p_node.ranks:
            await rank.wait(1)
            await rank.init_transfer(1, 2)
            await rank.send_chunk(1, [5, 6], is_last=True)
        status = await d_rank.wait(1, terminal=True)
        staged_bytes = int(torch.count_nonzero(d_staging))
        base = p_node.staging_base
    layout = decode_cache.layout
    token = ctypes.string_at(layout.page_addr(0, 3), layout.token_bytes)
    return {"poll": status.poll, "reason": status.reason, "staged": staged_bytes, "token": token,
            "base": base, "tensor": p_staging.data_ptr()}  # fmt: skip


def test_staging_in_engine_tensors_carries_a_heterogeneous_tp_room() -> None:
    result = anyio.run(staged_room, backend="asyncio")
    assert result["poll"] is KVPoll.Success, result["reason"]
    assert result["base"] == result["tensor"], "the prefill staged in the engine's tensor"
    assert result["staged"] > 0, "the slices went through the decode engine's tensor"
    half = len(result["token"]) // 2
    assert set(result["token"][:half]) == {0x21} and set(result["token"][half:]) == {0x22}


def test_the_buffers_device_picks_the_executor() -> None:
    _, kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    assert executor_for([kv]).backend is Backend.NUMPY, "host memory: numpy, no torch import"
    on_gpu = msgspec.structs.replace(kv, device="cuda:0")
    if torch.cuda.is_available():
        assert executor_for([on_gpu]).backend in (Backend.TRITON, Backend.TORCH)
    else:
        with pytest.raises(RuntimeError, match="reach 'cuda:0' memory"):
            executor_for([on_gpu])
    with pytest.raises(Exception, match="one device's memory"):
        executor_for([kv, on_gpu])


def test_engine_memory_too_small_for_the_staging_slots_is_refused() -> None:
    memory = EngineMemory.of_tensor(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(Exception, match="needs 64 bytes but the engine's memory holds 10"):
        memory.check_holds(64, "the staging ring")
