"""Engine-registered KV buffers through real processes over Mooncake TCP: a prefill process
whose ranks describe their own tensors (KvBuffers) feeds an in-test decode node; every byte of
every tensor is checked against the room's pattern (and the end-to-end checksum is on).

- MLA: one latent buffer per layer, no V, replicated over TP: TP 2 -> 1, the latent arrives
  whole from prefill rank 0; rank 1 is a dummy and writes nothing.
- Per-layer item lengths and draft KV: layers whose heads differ in size, and a draft model's
  K/V with its own head count, head-sliced TP 2 -> 1; the decode lists its tensors in another
  order than the prefill.
- Head-major (HND) pages, staged: TP 2 -> 1 through the staging ring, one slice per page.
"""

from __future__ import annotations

import json
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

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).with_name("engine_buffers_proc.py")
NUM_PAGES = 33


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def tensor(role: str, layer: int, heads: int, head_bytes: int, order: str = "nhd",
           draft: bool = False) -> dict[str, Any]:  # fmt: skip
    return {"role": role, "layer": layer, "heads": heads, "head_bytes": head_bytes,
            "order": order, "draft": draft}  # fmt: skip


MLA: Model = [tensor("latent", layer, 1, 36) for layer in range(3)]
PER_LAYER: Model = [
    tensor("k", 0, 4, 16), tensor("v", 0, 4, 16), tensor("k", 1, 4, 8), tensor("v", 1, 4, 8),
    tensor("k", 0, 2, 12, draft=True), tensor("v", 0, 2, 12, draft=True),
]
HND: Model = [tensor(role, layer, 4, 8, "hnd") for role in ("k", "v") for layer in range(2)]
CASES = {
    "mla-latent": (MLA, True, False),
    "per-layer-item-lens-and-draft": (PER_LAYER, False, False),
    "hnd-staged": (HND, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_engine_buffers_land_byte_exact_from_tp2_into_tp1(tmp_path: Path, case: str) -> None:
    model, is_mla, staged = CASES[case]
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": 0.5}
    decode = EngineKv(model, 1, 0, NUM_PAGES, reverse=True)
    page_bytes = decode.kv.kv_buffers.page_bytes
    options = {"bootstrap": "127.0.0.1:0", "settings": settings, "model": model, "tp": 2,
               "num_pages": NUM_PAGES, "is_mla": is_mla,
               "staging_slot_bytes": 8 * page_bytes if staged else 0}  # fmt: skip
    transport = MooncakeTransport.open()
    async with anyio.create_task_group() as tasks, transport:
        async with prefill_process(tasks, options, script=SCRIPT) as prefill:
            bootstrap = prefill.ready["bootstrap"]
            async with DecodeNode(ranks=[decode.kv], transport=transport, is_mla=is_mla,
                                  staging_bytes=16 * page_bytes if staged else 0,
                                  settings=load_settings(**settings)) as node:  # fmt: skip
                rank = node.ranks[0]
                for room, tokens, pages in ((7, 10, [30, 3, 4]), (8, 16, [5, 6, 7, 8])):
                    assert pages_for(tokens) == len(pages)
                    await prefill.start_room(room, 0, tokens)
                    await rank.open(room, 0, bootstrap)
                    assert (await rank.wait(room)).poll is not KVPoll.Failed
                    await rank.publish_pages(room, pages)
                    with anyio.fail_after(30):
                        status = await rank.wait(room, terminal=True)
                    assert status.poll is KVPoll.Success, status.reason
                    assert decode.mismatches(room, pages) == [], json.dumps(model)
                    await rank.clear(room)
                    with anyio.fail_after(30):
                        await prefill.room_done[room].wait()
                    assert prefill.rooms[room] == ["Success", "Success"]
                # The bytes around the published pages are untouched (nothing landed elsewhere).
                for slot, array in enumerate(decode.arrays):
                    view = decode.pages_view(slot)
                    untouched = [p for p in range(NUM_PAGES) if p not in (30, 3, 4, 5, 6, 7, 8)]
                    assert not view[untouched].any(), f"buffer {slot} written outside its pages"
                    del array
        tasks.cancel_scope.cancel()
