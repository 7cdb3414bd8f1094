"""The host-copy gather and scatter of a staged chunk (small rooms, on the loop) move exactly
the bytes of the executor path (staged_slices), for whole pages and for head slices."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.dataplane.pure import PythonExecutor
from pdflow.io.kv_buffers import (
    HostKvCache,
    RankKv,
    copy_staged_host,
    host_cache_for_rank,
    staged_slices,
    writer_region,
)

GEOMETRY = {"num_layers": 2, "page_size": 4, "head_dim": 2, "total_kv_heads": 4}
PAGES = [3, 0, 5]


def rank(tp: int, index: int) -> tuple[HostKvCache, RankKv]:
    return host_cache_for_rank(tp_size=tp, tp_rank=index, num_pages=8, dtype=KvDtype.INT8,
                               **GEOMETRY)  # fmt: skip


def memory(cache: HostKvCache) -> np.ndarray:
    return np.ctypeslib.as_array(cache.memory)


@pytest.mark.parametrize("source_tp", [1, 2])
def test_host_copies_gather_and_scatter_the_executors_bytes(source_tp: int) -> None:
    source, destination = rank(source_tp, source_tp - 1), rank(1, 0)
    memory(source[0])[:] = np.random.default_rng(7).integers(0, 256, len(source[0].memory))
    region = writer_region(source[1].kv_buffers, True, source[1].tp, destination[1].tp,
                           destination[1].kv_buffers)  # fmt: skip
    assert region is not None
    nbytes = len(PAGES) * region.page_bytes
    slots = [(ctypes.c_uint8 * nbytes)() for _ in range(2)]
    copy_staged_host(region, PAGES, ctypes.addressof(slots[0]), gather=True)
    for page in staged_slices(region, PAGES, ctypes.addressof(slots[1])):
        PythonExecutor().gather(page)
    assert bytes(slots[0]) == bytes(slots[1]) and any(slots[0])

    # Two decode ranks alike, one scattered each way, from the same staged bytes.
    targets = [rank(1, 0), rank(1, 0)]
    scattered = writer_region(targets[0][1].kv_buffers, False, source[1].tp, targets[0][1].tp,
                              targets[0][1].kv_buffers)  # fmt: skip
    assert scattered is not None
    where = ctypes.addressof(slots[0]) + scattered.chunk_offset(len(PAGES), 0)
    copy_staged_host(scattered, PAGES, where, gather=False)
    other = writer_region(targets[1][1].kv_buffers, False, source[1].tp, targets[1][1].tp,
                          targets[1][1].kv_buffers)  # fmt: skip
    assert other is not None
    for page in staged_slices(other, PAGES, where):
        PythonExecutor().scatter(page)
    assert bytes(targets[0][0].memory) == bytes(targets[1][0].memory)
    assert any(targets[0][0].memory)
