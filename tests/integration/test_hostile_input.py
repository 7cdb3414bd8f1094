"""Hostile input against real nodes on loopback (real ZMQ and HTTP, an in-process transport):
each finding of issue 13 as a test. Every test ends with a normal room whose bytes the decode
verified (checksums on), so "the node survived" means it still serves, not just that it runs."""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import pytest
import zmq
import zmq.asyncio

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import PeerId
from pdflow.io.codec import MAGIC, MsgpackCodec
from pdflow.io.node_common import NodeLifecycle
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import load_settings
from tests.integration.test_nodes_inprocess import one_room, two_nodes

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

# A map whose first key is not the type tag, then 999 nested one-element arrays: 1,017 bytes.
NESTED_FRAME = [MAGIC, b"1", b"\x81\xa8abcdefgh" + b"\x91" * 999 + b"\x00", b""]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def forge(address: str, frame_lists: Iterable[list[bytes]]) -> None:
    """Send raw frame lists to a control socket, as any process on the network could."""
    context = zmq.asyncio.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"tcp://{address}")
    for frames in frame_lists:
        await push.send_multipart(frames)
    push.close()
    context.term()


async def dropped_at_least(node: NodeLifecycle, reason: str, count: int) -> None:
    metrics = node.runtime.metrics
    with anyio.fail_after(20):
        while metrics.value("pdflow_dropped_frames_total", {"reason": reason}) < count:
            await anyio.sleep(0.01)


async def test_a_1017_byte_nested_frame_kills_neither_prefill_nor_decode(
    tmp_path: anyio.Path,
) -> None:
    assert sum(len(frame) for frame in NESTED_FRAME) == 1017
    settings = load_settings(env={}, trace_dir=str(tmp_path), checksum=True)
    async with two_nodes(settings) as (p_node, d_node):
        for node in (p_node, d_node):
            for rank in node.ranks:
                await forge(rank.peer.address, [NESTED_FRAME])
            await dropped_at_least(node, "undecodable", len(node.ranks))
        assert await one_room(p_node, d_node, 1) is KVPoll.Success


def forged_kv_args(d_node: DecodeNode, prefill: PeerId, decode_address: str) -> list[bytes]:
    """A KvArgs naming a real prefill rank, from a "decode" at ``decode_address``."""
    decode = PeerId(decode_address, "forged", 0)
    args = d_node.ranks[0].kv.kv_args(decode, prefill, "127.0.0.1:1")
    return MsgpackCodec().encode(args, None)


@pytest.mark.timeout(60)  # old main hung here forever in context.term()
async def test_a_forged_kv_args_with_a_bad_address_neither_kills_nor_hangs_the_prefill(
    tmp_path: anyio.Path,
) -> None:
    settings = load_settings(env={}, trace_dir=str(tmp_path), checksum=True)
    async with two_nodes(settings) as (p_node, d_node):
        rank = p_node.ranks[0]
        await forge(rank.peer.address, [forged_kv_args(d_node, rank.peer, "127.0.0.1:notaport"),
                                        forged_kv_args(d_node, rank.peer, "ipc:///tmp/x")])
        metrics = p_node.runtime.metrics
        with anyio.fail_after(10):
            while (metrics.value("pdflow_control_refused_sends_total", {"reason": "connect_failed"})
                   + metrics.value("pdflow_control_refused_sends_total",
                                   {"reason": "bad_address"})) < 2:  # fmt: skip
                await anyio.sleep(0.01)
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
    # Leaving the block returned: every socket, the failed one included, was closed.
