"""Pipeline parallelism through the nodes, real processes over Mooncake TCP: two prefill
processes, one per pipeline stage (the first hosts the registry, the second registers with it),
each rank handing pdflow only its stage's layers (KvBuffers with those layer ids), feed a decode
that holds every layer. The decode does not report Success while a stage has not written, and
then holds every layer's bytes (checked byte by byte, checksum on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import load_settings
from pdflow.transport.mooncake import MooncakeTransport

from .engine_buffers import EngineKv, Model, pages_for
from .node_harness import prefill_process
from .test_nodes_engine_buffers import NUM_PAGES, SCRIPT, tensor

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

# Four layers of K and V (4 heads of 8 bytes), tensor ids fixed for the whole model.
MODEL: Model = [{**tensor(role, layer, 4, 8), "id": 2 * layer + (role == "v")}
                for layer in range(4) for role in ("k", "v")]  # fmt: skip
STAGES = ([t for t in MODEL if t["layer"] < 2], [t for t in MODEL if t["layer"] >= 2])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("prefill_tp", [1, 2], ids=["tp1", "tp2-head-slices"])
async def test_every_stage_writes_its_layers_and_success_waits_for_all(
    tmp_path: Path, prefill_tp: int
) -> None:
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": 0.5}
    decode = EngineKv(MODEL, 1, 0, NUM_PAGES)

    def stage(pp_rank: int, bootstrap: str) -> dict[str, Any]:
        return {"bootstrap": bootstrap, "settings": settings, "model": STAGES[pp_rank],
                "tp": prefill_tp, "num_pages": NUM_PAGES, "pp_size": 2, "pp_rank": pp_rank,
                "serve_bootstrap": pp_rank == 0}  # fmt: skip

    transport = MooncakeTransport.open()
    async with anyio.create_task_group() as tasks, transport:
        async with prefill_process(tasks, stage(0, "127.0.0.1:0"), script=SCRIPT) as first:
            bootstrap = first.ready["bootstrap"]
            async with (
                prefill_process(tasks, stage(1, bootstrap), script=SCRIPT) as second,
                DecodeNode(ranks=[decode.kv], transport=transport,
                           settings=load_settings(**settings)) as node,
            ):  # fmt: skip
                rank = node.ranks[0]
                room, tokens, pages = 7, 14, [30, 3, 4, 9]
                assert pages_for(tokens) == len(pages)
                await first.start_room(room, 0, tokens)
                await rank.open(room, 0, bootstrap)
                assert (await rank.wait(room)).poll is not KVPoll.Failed
                await rank.publish_pages(room, pages)
                with anyio.move_on_after(1.5) as waited:
                    await rank.wait(room, terminal=True)
                assert waited.cancel_called, "Success before the second stage wrote"
                assert decode.mismatches(room, pages) == ["k2", "v2", "k3", "v3"]
                await second.start_room(room, 0, tokens)
                with anyio.fail_after(30):
                    status = await rank.wait(room, terminal=True)
                assert status.poll is KVPoll.Success, status.reason
                assert decode.mismatches(room, pages) == []
                await rank.clear(room)
                with anyio.fail_after(30):
                    await first.room_done[room].wait()
                    await second.room_done[room].wait()
                assert first.rooms[room] == second.rooms[room] == ["Success"] * prefill_tp
        tasks.cancel_scope.cancel()
