"""SGLang 0.5.23's prefill hands a sender that ``supports_host_tensor_indices`` its page ids
while they are still being copied from the GPU (a pinned CPU tensor) with ``indices_event``,
the CUDA event after the copy (and after the forward pass that wrote the chunk). pdflow's
sender must read the ids only once the event completed, off the scheduler, and pass the
event on as the chunk's ``ready``. No GPU: the copy and its event are stood in for by a
tensor written after ``send()`` returned and an event that completes when the test says."""

from __future__ import annotations

import threading
from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import anyio
import torch
from sglang.srt.plugins import load_plugins

load_plugins()  # the pdflow plugin's hooks, as in every SGLang process

from pdflow.io.node_prefill import PrefillNode  # noqa: E402
from pdflow.sglang.conn import PdflowKVManager, PdflowKVSender  # noqa: E402
from pdflow.sglang.rooms import RoomBook  # noqa: E402


class _CopyEvent:
    """What the sender needs of a torch.cuda.Event: a blocking synchronize()."""

    def __init__(self) -> None:
        self.copied = threading.Event()

    def synchronize(self) -> None:
        self.copied.wait(timeout=10)


class _Rank:
    def __init__(self) -> None:
        self.chunks: list[tuple[list[int], bool, Any]] = []

    async def open_room(self, room: int, generation: int) -> None: ...

    async def init_transfer(self, room: int, num_pages: int, aux_index: Any = None) -> None: ...

    async def send_chunk(self, room: int, pages: list[int], is_last: bool, state: Any = (),
                         ready: Any = None) -> None:  # fmt: skip
        self.chunks.append((pages, is_last, ready))


def _sender() -> tuple[PdflowKVSender, list[Any], _Rank]:
    mgr = PdflowKVManager.__new__(PdflowKVManager)
    mgr.book, queued, rank = RoomBook(), [], _Rank()

    def run(room: int, name: str, call: Any, *args: Any) -> None:
        queued.append(partial(call, *args))  # the call as the loop would run it

    mgr.run = run  # type: ignore[method-assign]
    mgr.node = PrefillNode.__new__(PrefillNode)
    mgr.node.ranks = [rank]  # type: ignore[list-item]
    mgr.rank_kv = SimpleNamespace(state=())  # type: ignore[assignment]
    sender = PdflowKVSender(mgr, "10.0.0.1:8998", 300)
    sender.init(4, 0)
    queued.clear()  # open_room and init_transfer: not under test
    return sender, queued, rank


def test_page_ids_are_read_after_their_copy_from_the_gpu_completed() -> None:
    sender, queued, rank = _sender()
    with patch.object(torch.cuda, "is_available", return_value=True):
        assert sender.supports_host_tensor_indices  # so SGLang hands it indices_event
    host_pages = torch.zeros(4, dtype=torch.int64)  # pinned buffer, copy not landed yet
    event = _CopyEvent()
    sender.send(host_pages, None, num_kv_tokens=16, indices_event=event)  # returns at once
    assert len(queued) == 1 and rank.chunks == []

    async def loop_runs_the_call() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(queued[0])
            await anyio.sleep(0.05)
            assert rank.chunks == []  # waiting for the copy, not reading zeros
            host_pages.copy_(torch.tensor([5, 6, 7, 8]))  # the D2H copy lands
            event.copied.set()

    anyio.run(loop_runs_the_call)
    assert rank.chunks == [([5, 6, 7, 8], True, event)]


def test_without_an_event_the_page_ids_are_read_at_once_and_no_cuda_means_no_events() -> None:
    sender, queued, rank = _sender()
    with patch.object(torch.cuda, "is_available", return_value=False):
        assert not sender.supports_host_tensor_indices  # SGLang copies the ids itself
    pages = torch.tensor([1, 2])
    sender.send(pages, None)
    pages.zero_()  # SGLang may reuse its buffer after send() returned
    anyio.run(queued[0])
    assert rank.chunks == [([1, 2], False, None)]
