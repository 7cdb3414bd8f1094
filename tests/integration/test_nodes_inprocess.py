"""Both nodes in this process (real ZMQ, HTTP and an in-process transport): bad frames at the
control ports, the end-to-end digest, and shutdown leaving nothing behind."""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from pdflow.core.dataplane.buffers import destination_slices, exchanged_slices
from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import PROTOCOL_VERSION, PeerId, StatusReport
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.dataplane.host import memmove_write_ops
from pdflow.io import node_common
from pdflow.io.codec import HEADER_BYTES, MsgpackCodec, wire_frames
from pdflow.io.kv_buffers import (
    TransferPlanner,
    default_executor,
    host_cache_for_rank,
    kv_digest,
)
from pdflow.io.node_common import RoomStatus
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import Settings, load_settings
from pdflow.transport import InProcessFabric

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

GEOMETRY: dict[str, Any] = {"num_layers": 2, "page_size": 4, "head_dim": 8, "total_kv_heads": 4,
            "dtype": KvDtype.FP16}  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def two_nodes(settings: Settings) -> AsyncIterator[tuple[PrefillNode, DecodeNode]]:
    fabric = InProcessFabric()
    prefill = [host_cache_for_rank(tp_size=2, tp_rank=r, num_pages=32, **GEOMETRY)
               for r in range(2)]  # fmt: skip
    decode = [host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=32, **GEOMETRY)]
    for cache, _ in prefill:
        ctypes.memset(cache.base_addr, 0x5A, cache.nbytes)
    async with (
        fabric.create_transport() as p_transport, fabric.create_transport() as d_transport,
        PrefillNode(ranks=[kv for _, kv in prefill], transport=p_transport,
                    bootstrap="127.0.0.1:0", settings=settings) as p_node,
        DecodeNode(ranks=[kv for _, kv in decode], transport=d_transport,
                   settings=settings) as d_node,
    ):  # fmt: skip
        yield p_node, d_node


async def one_room(p_node: PrefillNode, d_node: DecodeNode, room: int) -> KVPoll:
    d_rank = d_node.ranks[0]
    for rank in p_node.ranks:
        await rank.open_room(room, 0)
    await d_rank.open(room, 0, p_node.bootstrap)
    await d_rank.wait(room)
    await d_rank.publish_pages(room, [room % 32, (room + 1) % 32])
    for rank in p_node.ranks:
        await rank.wait(room)
        await rank.init_transfer(room, 2)
        await rank.send_chunk(room, [3, 4], True)
    with anyio.fail_after(10):
        status = await d_rank.wait(room, terminal=True)
    await d_rank.clear(room)
    for rank in p_node.ranks:
        await rank.wait(room, terminal=True)
        await rank.clear(room)
    return status.poll


async def test_bad_frames_are_counted_dropped_and_change_nothing(tmp_path: anyio.Path) -> None:
    settings = load_settings(env={}, trace_dir=str(tmp_path), checksum=True)
    async with two_nodes(settings) as (p_node, d_node):
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        before = (d_node.ranks[0].snapshot(),
                  [r.snapshot() for r in p_node.ranks])  # fmt: skip
        good = MsgpackCodec().encode(StatusReport(9, 0, KVPoll.Success, p_node.ranks[0].peer,
                                                  d_node.ranks[0].peer), None)  # fmt: skip
        bad_frames = [
            [b"\x00garbage"],
            wire_frames(good[0][HEADER_BYTES:], version=PROTOCOL_VERSION + 1),
            wire_frames(b"\xc1not msgpack"),
            wire_frames(msgspec.msgpack.encode({"type": "drop_tables"})),
            [b"\x00" * (60 << 10)] * 20,  # each frame fits the ZMQ limit, all 1.2 MiB do not
            # Over the ZMQ limit (MAXMSGSIZE): its connection is cut, nothing read or counted.
            wire_frames(b"\x00" * (2 << 20)),
        ]
        context = zmq.asyncio.Context()
        try:
            for address in [d_node.ranks[0].peer.address, *(r.peer.address for r in p_node.ranks)]:
                push = context.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 2000)
                push.connect(f"tcp://{address}")
                for frames in bad_frames:
                    await push.send_multipart(frames)
                push.close()
            metrics = (d_node.runtime.metrics, p_node.runtime.metrics)
            with anyio.fail_after(5):
                while sum(m.value("pdflow_dropped_frames_total", {"reason": reason})
                          for m in metrics for reason in ("oversized",)) < 3:  # fmt: skip
                    await anyio.sleep(0.01)
        finally:
            context.term()
        after = (d_node.ranks[0].snapshot(),
                 [r.snapshot() for r in p_node.ranks])  # fmt: skip
        assert after == before
        expected = {"malformed": 1, "bad_version": 1, "undecodable": 2, "oversized": 1}
        for node in (d_node, p_node):
            ranks = len(node.ranks)
            for reason, count in expected.items():
                value = node.runtime.metrics.value("pdflow_dropped_frames_total",
                                                   {"reason": reason})  # fmt: skip
                assert value == count * ranks, (node.runtime.role, reason, value)
        # A well-formed status for a room nobody has: refused by the core, counted.
        context = zmq.asyncio.Context()
        push = context.socket(zmq.PUSH)
        push.connect(f"tcp://{d_node.ranks[0].peer.address}")
        await push.send_multipart(good)
        push.close(linger=2000)
        context.term()
        with anyio.fail_after(5):
            while not d_node.runtime.metrics.value("pdflow_core_dropped_total",
                                                   {"kind": "unknown_room"}):  # fmt: skip
                await anyio.sleep(0.01)
        assert await one_room(p_node, d_node, 2) is KVPoll.Success


async def test_shutdown_leaves_no_task_socket_or_thread_behind(tmp_path: anyio.Path) -> None:
    settings = load_settings(env={}, trace_dir=str(tmp_path))

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async with two_nodes(settings) as (p_node, d_node):  # warm imports and lazy singletons
        await one_room(p_node, d_node, 1)
    await anyio.sleep(0.1)
    fds, tasks = open_fds(), len(asyncio.all_tasks())
    async with two_nodes(settings) as (p_node, d_node):
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        assert open_fds() > fds
    await anyio.sleep(0.1)
    assert open_fds() == fds
    assert len(asyncio.all_tasks()) == tasks


async def test_trace_batches_are_written_at_the_decodes_terminal_status(
    tmp_path: anyio.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The room's path ends at the decode's Success: every trace batch kept on the loop so
    # far (both nodes') is written on the loop's next pass after the waiter it woke, not at
    # the deferral's delay (lifted here past the test), and not at the prefill's own
    # Success (its StatusReport is then still on the way to the decode).
    monkeypatch.setattr(node_common, "_TRACE_WRITE_DELAY_S", 60.0)
    settings = load_settings(env={}, trace_dir=str(tmp_path))
    async with two_nodes(settings) as (p_node, d_node):
        recorders = [p_node.runtime.recorder, d_node.runtime.recorder]
        prefill_pending_at_decode_success: list[int] = []

        def on_event(event: object) -> None:
            if isinstance(event, RoomStatus) and event.poll is KVPoll.Success:
                prefill_pending_at_decode_success.append(len(recorders[0]._pending))

        d_node.watch(on_event)
        d_rank = d_node.ranks[0]
        await d_rank.open(7, 0, p_node.bootstrap)
        for rank in p_node.ranks:
            await rank.open_room(7, 0)
        await d_rank.wait(7)
        await d_rank.publish_pages(7, [1, 2])
        for rank in p_node.ranks:
            await rank.wait(7)
            await rank.init_transfer(7, 2)
            await rank.send_chunk(7, [3, 4], True)
        with anyio.fail_after(10):
            assert (await d_rank.wait(7, terminal=True)).poll is KVPoll.Success
        kept = sum(len(r._pending) for r in recorders)
        await anyio.sleep(0)
        assert kept > 0, "nothing was kept for later: the test would show nothing"
        assert [len(r._pending) for r in recorders] == [0, 0]
        assert prefill_pending_at_decode_success and prefill_pending_at_decode_success[0] > 0


def test_digest_matches_across_tp_and_catches_a_misplaced_page() -> None:
    """The prefill's per-transfer digests sum to the decode's digest of what landed."""
    executor = default_executor()
    prefill = [host_cache_for_rank(tp_size=2, tp_rank=r, num_pages=16, **GEOMETRY)
               for r in range(2)]  # fmt: skip
    decode_cache, decode_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=16, **GEOMETRY)
    peer = PeerId("127.0.0.1:1", "d", 0)
    for index, (cache, _) in enumerate(prefill):
        buffer = (ctypes.c_uint8 * cache.nbytes).from_address(cache.base_addr)
        for offset in range(cache.nbytes):
            buffer[offset] = (offset * 7 + index * 29) % 251
    dst_pages, src_pages = (5, 6, 9), (2, 3, 7)
    for _, kv in prefill:
        args = decode_kv.kv_args(peer, PeerId("127.0.0.1:2", "p", kv.tp_rank), "s")
        sent = 0
        for lo, hi in ((0, 2), (2, 3)):
            start = StartTransfer(1, 0, 0, peer, "s", src_pages[lo:hi], dst_pages[lo:hi],
                                  hi == 3, None, None)  # fmt: skip
            memmove_write_ops(TransferPlanner(kv).plan(start, args))
            sent_slices = exchanged_slices(kv.kv_buffers, True, kv.tp, decode_kv.tp, args.layout)
            sent += kv_digest(executor, sent_slices, start.src_pages, start.dst_pages, 16)
        slices = destination_slices(decode_kv.kv_buffers, kv.tp, decode_kv.tp)
        received = kv_digest(executor, slices, dst_pages, dst_pages, 16)
        assert received == sent % (1 << 64)
        # The same bytes in the wrong page are caught.
        moved = kv_digest(executor, slices, dst_pages, (5, 9, 6), 16)
        assert moved != received
    del decode_cache


async def test_an_engine_call_cancelled_while_its_step_sends_still_carries_out_the_step(
    tmp_path: anyio.Path,
) -> None:
    """The core moved when the call's step ran; an engine that gives up on the call (its own
    deadline) while a send of that step waits for room must not leave the step's later
    outputs undone: here the status the waiters read and the ABORT to the second writer,
    which the core never sends again."""
    from pdflow.core.protocol.messages import Abort

    settings = load_settings(env={}, trace_dir=str(tmp_path), trace_enabled=False)
    async with two_nodes(settings) as (p_node, d_node):
        d_rank, room = d_node.ranks[0], 5
        for rank in p_node.ranks:
            await rank.open_room(room, 0)
        await d_rank.open(room, 0, p_node.bootstrap)
        await d_rank.wait(room)
        await d_rank.publish_pages(room, [1, 2])
        for rank in p_node.ranks:
            await rank.wait(room)
        channel = d_node._channels[0]
        real_send = channel.send_soon
        aborts: list[str] = []

        def full_queue_for_aborts(address: str, message: Any, msg_id: str | None) -> Any:
            if not isinstance(message, Abort):
                return real_send(address, message, msg_id)
            aborts.append(address)

            async def wait_for_room_then_send() -> bool:
                await anyio.sleep(0.5)  # the peer's queue was full (ControlChannel's wait)
                return bool(real_send(address, message, msg_id))

            return wait_for_room_then_send()

        channel.send_soon = full_queue_for_aborts  # type: ignore[method-assign]
        with anyio.move_on_after(0.1):  # the engine's deadline on abort()
            await d_rank.abort(room, "client went away")
        with anyio.fail_after(10):
            assert (await d_rank.wait(room, terminal=True)).poll is KVPoll.Failed
            for rank in p_node.ranks:
                assert (await rank.wait(room, terminal=True)).poll is KVPoll.Failed
        assert len(aborts) == len(p_node.ranks), "an ABORT per writer, each sent"


async def test_a_rotation_that_fails_leaves_the_decode_serving_and_is_counted(
    tmp_path: anyio.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The quarantine threshold spawns the rotation in the node's task group: a new engine
    that will not start ended the node, every room of it with it."""
    from pdflow.transport.base import TransportError
    from pdflow.transport.inprocess import InProcessTransport

    async def engine_will_not_start(self: InProcessTransport) -> str:
        raise TransportError("Mooncake engine failed to initialise (status -1)")

    monkeypatch.setattr(InProcessTransport, "can_rotate", property(lambda self: True))
    monkeypatch.setattr(InProcessTransport, "rotate", engine_will_not_start)
    settings = load_settings(env={}, trace_dir=str(tmp_path), trace_enabled=False)
    async with two_nodes(settings) as (p_node, d_node):
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        d_node._rotation_wanted = True  # what update_quarantine does past the threshold
        d_node.spawn(lambda: d_node._rotate_when_wanted("quarantine_threshold"))
        await anyio.sleep(0.2)
        assert await one_room(p_node, d_node, 2) is KVPoll.Success
        failed = d_node.runtime.metrics.session_rotations.labels("failed")._value.get()
        assert failed == 1 and not d_node.rotations


async def test_a_verification_works_on_the_pages_of_the_step_that_asked_for_it(
    tmp_path: anyio.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verification task starts a loop turn after its step; an engine that clears and
    reopens the room id meanwhile gives the id other pages. The task must scatter into and
    check the pages of the generation it verifies, never the newer one's."""
    settings = load_settings(env={}, trace_dir=str(tmp_path), trace_enabled=False, checksum=True)
    verify = DecodeNode.verify
    swapped: list[tuple[int, ...]] = []

    async def reopened_first(self: DecodeNode, host: Any, request: Any, *rest: Any) -> None:
        # What a reopen of the room id does to the node's records before the task runs.
        key = (host.rank, request.room)
        swapped.append(self.room_pages[key])
        self.room_pages[key] = (30, 31)
        await verify(self, host, request, *rest)

    monkeypatch.setattr(DecodeNode, "verify", reopened_first)
    async with two_nodes(settings) as (p_node, d_node):
        assert await one_room(p_node, d_node, 3) is KVPoll.Success
    assert swapped == [(3, 4)], "the room was verified (staged TP=2 -> TP=1, digests on)"
