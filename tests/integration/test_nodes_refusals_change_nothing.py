"""A refused node call changes nothing (docs/embedding.md): a duplicate open keeps the room's
status (waiters and the decode's page release read it), a refused chunk leaves no readiness
object behind for the id's next room, an open whose DP registration fails leaves nothing open,
admit after publish_pages is refused rather than counting pages that may be released,
finish_request naming another generation than the admitted one is refused, and so is
finish_request for a failed room whose pages are quarantined (admission would count them free),
but not for a failed room whose published pages came straight back."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.bootstrap_client import BootstrapError
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode, PrefillPlacement
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric
from tests.integration.node_harness import inprocess_nodes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL: dict[str, Any] = {"total_kv_heads": 2, "num_layers": 2, "page_size": 4, "head_dim": 8,
                         "dtype": KvDtype.FP16, "num_pages": 16}  # fmt: skip


class Ready:
    """A readiness object that counts its waits."""

    def __init__(self) -> None:
        self.waits = 0
        self.lock = threading.Lock()

    def synchronize(self) -> None:
        with self.lock:
            self.waits += 1


_CACHES: list[Any] = []  # the host memory the nodes' buffers point into must outlive them


def _nodes(**placement: Any) -> Any:
    settings = load_settings(trace_enabled=False)
    fabric = InProcessFabric()
    p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)
    d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)
    _CACHES[:] = [p_cache, d_cache]
    p_transport, d_transport = fabric.create_transport(), fabric.create_transport()
    prefill = PrefillNode(ranks=[p_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                          settings=settings,
                          placement=PrefillPlacement(**placement) if placement else None)
    decode = DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings)
    return p_transport, d_transport, prefill, decode


def _with_nodes(story: Callable[[PrefillNode, DecodeNode], Awaitable[None]],
                **placement: Any) -> None:  # fmt: skip
    async def run() -> None:
        p_transport, d_transport, prefill, decode = _nodes(**placement)
        async with p_transport, d_transport, prefill as p_node, decode as d_node:
            await story(p_node, d_node)

    anyio.run(run, backend="asyncio")


def test_a_refused_duplicate_open_keeps_the_rooms_status() -> None:
    async def story(p_node: PrefillNode, d_node: DecodeNode) -> None:
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        await p_rank.open_room(7, 0)
        await d_rank.open(7, 0, p_node.bootstrap)
        ready = await d_rank.wait(7)
        with pytest.raises(LocalProtocolError, match="already open"):
            await d_rank.open(7, 0, p_node.bootstrap)  # a router retry racing the clear
        assert d_node.runtime.events.status(0, 7) == ready
        with anyio.fail_after(5):  # hung forever when the refusal dropped the status
            assert await d_rank.wait(7) == ready
        await d_rank.admit(7, input_len=8, max_new=0)
        await d_rank.publish_pages(7, [3, 4])
        await p_rank.wait(7)
        with pytest.raises(LocalProtocolError, match="already open"):
            await p_rank.open_room(7, 0)
        with anyio.fail_after(5):
            assert (await p_rank.wait(7)).poll is KVPoll.WaitingForInput
        await p_rank.init_transfer(7, 2)
        await p_rank.send_chunk(7, [0, 1], True)
        with anyio.fail_after(5):
            assert (await d_rank.wait(7, terminal=True)).poll is KVPoll.Success
        with pytest.raises(LocalProtocolError):
            await d_rank.open(7, 0, p_node.bootstrap)
        await d_rank.clear(7)
        # A Success room's pages stay admitted until the engine finishes decoding on them.
        assert d_node.admission[0].admitted == 1
        with pytest.raises(InvalidInput, match="room 7 is admitted as 7/0"):
            d_rank.finish_request(7, 1)  # a wrong generation would leave the pages counted
        assert d_node.admission[0].admitted == 1
        d_rank.finish_request(7, 0)
        assert d_node.admission[0].admitted == 0
        d_rank.finish_request(7, 0)  # again: nothing admitted, nothing to do
        with pytest.raises(LocalProtocolError, match="room 8 is not open"):
            await d_rank.wait(8)  # never opened: refused at once, not a wait for good

    _with_nodes(story)


def test_a_refused_chunk_leaves_no_readiness_object_for_the_ids_next_room() -> None:
    async def story(p_node: PrefillNode, d_node: DecodeNode) -> None:
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        stale = Ready()
        with pytest.raises(LocalProtocolError):
            await p_rank.send_chunk(9, [0], True, ready=stale)  # a late chunk, room gone
        assert p_node.source_ready == {}
        await p_rank.open_room(9, 1)
        await d_rank.open(9, 1, p_node.bootstrap)
        await d_rank.wait(9)
        await d_rank.publish_pages(9, [2])
        await p_rank.wait(9)
        await p_rank.init_transfer(9, 1)
        await p_rank.send_chunk(9, [0], True)
        with anyio.fail_after(5):
            assert (await d_rank.wait(9, terminal=True)).poll is KVPoll.Success
        assert stale.waits == 0, "the next room waited on another request's readiness"

    _with_nodes(story)


def test_an_open_whose_dp_registration_fails_leaves_nothing_open() -> None:
    async def story(p_node: PrefillNode, _: DecodeNode) -> None:
        p_rank = p_node.ranks[0]
        registered: list[int] = []

        async def unreachable(room: int) -> None:
            raise BootstrapError("registry unreachable")

        async def reachable(room: int) -> None:
            registered.append(room)

        p_node.register_dp_rank = unreachable  # type: ignore[method-assign]
        with pytest.raises(BootstrapError):
            await p_rank.open_room(11, 0)
        assert p_rank.poll(11) is None
        p_node.register_dp_rank = reachable  # type: ignore[method-assign]
        await p_rank.open_room(11, 0)  # the same id and generation: nothing was open
        assert p_rank.poll(11) is KVPoll.Bootstrapping and registered == [11]

    _with_nodes(story, dp_size=2, dp_rank=0, load_balance_method="round_robin")


def test_admit_after_publish_pages_is_refused() -> None:
    async def story(p_node: PrefillNode, d_node: DecodeNode) -> None:
        p_rank, d_rank = p_node.ranks[0], d_node.ranks[0]
        await p_rank.open_room(4, 0)
        await d_rank.open(4, 0, p_node.bootstrap)
        await d_rank.wait(4)
        await d_rank.publish_pages(4, [1, 2, 3])
        await p_rank.abort(4, "prefill gave up")
        with anyio.fail_after(5):
            assert (await d_rank.wait(4, terminal=True)).poll is KVPoll.Failed
        with pytest.raises(InvalidInput, match="admit before publish_pages"):
            await d_rank.admit(4, input_len=12, max_new=0)
        await d_rank.clear(4)
        assert d_node.admission[0].admitted == 0

    _with_nodes(story)


def test_finish_request_of_a_failed_room_whose_pages_are_quarantined_is_refused() -> None:
    """The room is aborted while the prefill's write to its pages is in flight: the pages stay
    quarantined until the prefill drains (no receiver-side fence here, as over Mooncake). An
    engine that calls finish_request for it is refused and admission still counts the pages;
    the request leaves admission by itself once they are released."""

    async def run() -> None:
        settings = load_settings(trace_enabled=False)
        fabric = InProcessFabric(receiver_fence=False)
        p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)
        d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)
        async with inprocess_nodes([p_kv], [d_kv], settings, fabric) as (p_node, d_node):
            p_rank, d_rank, gate = p_node.ranks[0], d_node.ranks[0], d_node.admission[0]
            await p_rank.open_room(5, 0)
            await d_rank.open(5, 0, p_node.bootstrap)
            await d_rank.wait(5)
            pages = await d_rank.admit(5, input_len=8, max_new=4)
            hold = fabric.hold_writes(d_node.transport.session_id)
            await d_rank.publish_pages(5, list(range(pages)))
            await p_rank.wait(5)
            await p_rank.init_transfer(5, 2)
            await p_rank.send_chunk(5, [0, 1], True)
            with anyio.fail_after(5):
                await hold.wait_for_writer()
            await d_rank.abort(5, "the client went away")
            assert (await d_rank.wait(5, terminal=True)).poll is KVPoll.Failed
            await d_rank.clear(5)
            assert [q.pages for q in d_rank.quarantine()] == [tuple(range(pages))]
            with pytest.raises(InvalidInput, match="did not succeed and pdflow still holds"):
                d_rank.finish_request(5, 0)
            assert gate.admitted == 1 and gate.is_admitted("5/0")
            hold.release()  # the write lands in the held pages, then the prefill ACKs
            with anyio.fail_after(5):
                while d_rank.quarantine() or gate.admitted:
                    await anyio.sleep(0.01)
            assert d_rank.allocatable == MODEL["num_pages"]
            d_rank.finish_request(5, 0)  # not admitted any more: a no-op
        del p_cache, d_cache

    anyio.run(run, backend="asyncio")


def test_pages_published_for_a_failed_room_are_not_counted_as_held() -> None:
    """A room that failed before its pages were published gets them back within the publish
    (PagesReleased at once): pdflow holds nothing of it, so finish_request is the no-op the
    docs promise, and nothing of the room stays in the decode's bookkeeping."""

    async def story(p_node: PrefillNode, d_node: DecodeNode) -> None:
        p_rank, d_rank, gate = p_node.ranks[0], d_node.ranks[0], d_node.admission[0]
        await p_rank.open_room(5, 0)
        await d_rank.open(5, 0, p_node.bootstrap)
        await d_rank.wait(5)
        pages = await d_rank.admit(5, input_len=8, max_new=4)
        await d_rank.abort(5, "the client went away")
        assert (await d_rank.wait(5, terminal=True)).poll is KVPoll.Failed
        await d_rank.publish_pages(5, list(range(pages)))
        assert d_rank.allocatable == MODEL["num_pages"] and not gate.is_admitted("5/0")
        d_rank.finish_request(5, 0)  # its pages came back: a no-op, not a refusal

    _with_nodes(story)
