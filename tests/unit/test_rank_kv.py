"""RankKv holds what owns the memory it describes: a node keeps its RankKv, so the memory
cannot be freed while the node writes into it."""

from __future__ import annotations

import ctypes
import gc
import weakref

from pdflow.core.dataplane.layout import KvDtype
from pdflow.io.kv_buffers import HostKvCache, RankKv, host_cache_for_rank


def test_a_host_cache_lives_as_long_as_its_rank_kv() -> None:
    cache, kv = host_cache_for_rank(total_kv_heads=2, tp_size=1, tp_rank=0, num_layers=1,
                                    num_pages=4, page_size=2, head_dim=4,
                                    dtype=KvDtype.FP16)  # fmt: skip
    ctypes.memset(cache.base_addr, 0x5A, cache.nbytes)
    held = weakref.ref(cache)
    del cache
    gc.collect()
    assert held() is not None, "the cache was freed while its RankKv still names its memory"
    assert kv.owner is held()
    first = kv.kv_buffers.buffers[0]
    assert ctypes.string_at(first.addr, 4) == b"\x5a" * 4
    del kv
    gc.collect()
    assert held() is None  # the description was the last holder


def test_an_engine_hands_its_tensors_as_the_owner() -> None:
    cache = HostKvCache(num_layers=1, num_pages=4, page_size=2, num_heads=2, head_dim=4,
                        dtype=KvDtype.FP16)  # fmt: skip
    memory = weakref.ref(cache.memory)
    kv = RankKv(cache.layout, 1, 0, 2, owner=(cache.memory,))
    del cache
    gc.collect()
    assert memory() is not None and kv.owner == (memory(),)
