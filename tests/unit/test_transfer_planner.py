"""The prefill's planner keeps each peer layout's slice pairs; a kept pair must never plan
another layout's writes."""

from __future__ import annotations

import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.dataplane.planning import WriteOp, plan_buffers
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.protocol.messages import KvArgs, PeerId
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.io.kv_buffers import (
    HostKvCache,
    RankKv,
    TransferPlanner,
    host_cache_for_rank,
    peer_place,
)

GEOMETRY = {"page_size": 4, "head_dim": 8, "dtype": KvDtype.FP16}
ME = PeerId("127.0.0.1:1", "decode-life")


def _rank(tp_size: int = 1, tp_rank: int = 0, pages: int = 8,
          layers: int = 2) -> tuple[HostKvCache, RankKv]:  # fmt: skip
    return host_cache_for_rank(total_kv_heads=2, tp_size=tp_size, tp_rank=tp_rank,
                               num_pages=pages, num_layers=layers, **GEOMETRY)  # fmt: skip


def _start(src: tuple[int, ...], dst: tuple[int, ...]) -> StartTransfer:
    return StartTransfer(0, 0, 0, ME, "127.0.0.1:2", src, dst, True, None, None)


def _fresh(local: RankKv, start: StartTransfer, args: KvArgs) -> tuple[WriteOp, ...]:
    return plan_buffers(local.kv_buffers, local.tp, args.layout, peer_place(args),
                        start.src_pages, start.dst_pages)  # fmt: skip


def test_each_peer_layout_gets_its_own_writes_from_one_planner() -> None:
    _local_cache, local = _rank()
    caches = [_rank(), _rank(pages=16), _rank(tp_size=2, tp_rank=1)]  # kept alive: distinct memory
    peers = [kv.kv_args(ME, ME, f"127.0.0.1:{2 + n}") for n, (_, kv) in enumerate(caches)]
    planner = TransferPlanner(local)
    rooms = [_start((0, 1, 2), (5, 6, 7)), _start((3, 4), (1, 0))]
    for _ in range(2):  # the second round plans from the kept pairs
        for args in peers:
            for start in rooms:
                assert planner.plan(start, args) == _fresh(local, start, args)
    # Every peer's plan differs from the others' (distinct memory, or only some heads).
    plans = {planner.plan(rooms[0], args) for args in peers}
    assert len(plans) == len(peers)


def test_a_new_layout_from_the_same_peer_is_planned_afresh() -> None:
    """A decode that restarted announces a new KvArgs (new buffers) under the same address."""
    _local_cache, local = _rank()
    planner = TransferPlanner(local)
    start = _start((0, 1), (2, 3))
    old_cache, old_kv = _rank()
    first = planner.plan(start, old_kv.kv_args(ME, ME, "127.0.0.1:2"))
    new_cache, new_kv = _rank()  # both caches alive: different memory
    after = new_kv.kv_args(ME, ME, "127.0.0.1:2")
    assert planner.plan(start, after) == _fresh(local, start, after) != first
    assert old_cache.base_addr != new_cache.base_addr


def test_a_planner_switched_out_of_pipeline_stage_replans() -> None:
    """A pipeline stage (here layer 0 of a peer's two) writes only the layers it holds; the
    same planner, no longer a stage, must refuse that peer again, not reuse the stage's plan."""
    _local_cache, local = _rank(layers=1)
    _peer_cache, peer_kv = _rank()
    args = peer_kv.kv_args(ME, ME, "127.0.0.1:2")
    planner = TransferPlanner(local)
    planner.stage = True
    start = _start((0,), (1,))
    assert len(planner.plan(start, args)) == 2, "layer 0's K and V"
    planner.stage = False
    with pytest.raises(InvalidInput, match="different KV tensors"):
        planner.plan(start, args)
