"""A node pays the full garbage collection start-up left due while starting, not on its first
rooms (``collect_garbage_at_start``), and changes no collector setting doing so.

The collector's automatic passes are switched off around each node's start, so the only
generation-2 pass the probe can see is one the node asked for.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

GEOMETRY: dict[str, Any] = {"num_layers": 2, "page_size": 4, "head_dim": 8, "total_kv_heads": 4,
            "dtype": KvDtype.FP16}  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextmanager
def full_passes_seen() -> Iterator[list[int]]:
    """The generations of every collection that ends inside, with automatic ones off."""
    seen: list[int] = []

    def probe(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            seen.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(probe)
    try:
        yield seen
    finally:
        gc.callbacks.remove(probe)
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("collect", [True, False])
async def test_each_node_runs_one_full_collection_as_it_starts(
    tmp_path: anyio.Path, collect: bool
) -> None:
    settings = load_settings(env={}, trace_dir=str(tmp_path), collect_garbage_at_start=collect)
    fabric = InProcessFabric()
    _p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=8, **GEOMETRY)
    _d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=8, **GEOMETRY)
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    async with fabric.create_transport() as p_transport, fabric.create_transport() as d_transport:
        prefill = PrefillNode(ranks=[p_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                              settings=settings)  # fmt: skip
        with full_passes_seen() as prefill_passes:
            await prefill.__aenter__()
        try:
            decode = DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings)
            with full_passes_seen() as decode_passes:
                await decode.__aenter__()
            await decode.__aexit__(None, None, None)
        finally:
            await prefill.__aexit__(None, None, None)
    expected = [2] if collect else []
    assert prefill_passes == expected
    assert decode_passes == expected
    assert (gc.get_threshold(), gc.get_freeze_count()) == (thresholds, frozen)
