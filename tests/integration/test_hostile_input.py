"""Hostile input against real nodes on loopback (real ZMQ and HTTP, an in-process transport):
each finding of issue 13 as a test. Every test ends with a normal room whose bytes the decode
verified (checksums on), so "the node survived" means it still serves, not just that it runs."""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.to_thread
import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from pdflow.core.dataplane.buffers import KvBuffer, KvBuffers, KvRole
from pdflow.core.dataplane.layout import AuxBuffer, KvDtype, packed_layout
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import Abort, KvArgs, KvArgsAccepted, PeerId, RoomMetadata
from pdflow.io.codec import DEFAULT_SMALL_MESSAGE_BYTES, MsgpackCodec, wire_frames
from pdflow.io.frame_auth import authenticated
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_common import NodeLifecycle
from pdflow.io.node_decode import DecodeNode
from pdflow.io.settings import Settings, load_settings
from pdflow.transport import InProcessFabric
from tests.integration.test_nodes_inprocess import GEOMETRY, one_room, two_nodes

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

# A map whose first key is not the type tag, then 999 nested one-element arrays: 1,017 bytes.
NESTED_FRAME = wire_frames(b"\x81\xa8abcdefgh" + b"\x91" * 999 + b"\x00")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def checked(tmp_path: anyio.Path, **overrides: Any) -> Settings:
    """Node settings with checksums on: a room's Success means its bytes were verified."""
    return load_settings(env={}, trace_dir=str(tmp_path), checksum=True, **overrides)


async def forge(address: str, frame_lists: Iterable[list[bytes]]) -> None:
    """Send raw frame lists to a control socket, as any process on the network could."""
    context = zmq.asyncio.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"tcp://{address}")
    for frames in frame_lists:
        await push.send_multipart(frames)
    push.close()
    # term() waits (LINGER) until the queued frames are out: off the event loop, since the
    # node reading them runs on it, and ZMQ takes only RECEIVE_HWM of them while it does not.
    await anyio.to_thread.run_sync(context.term)


async def dropped_at_least(node: NodeLifecycle, reason: str, count: int) -> None:
    metrics = node.runtime.metrics
    with anyio.fail_after(20):
        while metrics.value("pdflow_dropped_frames_total", {"reason": reason}) < count:
            await anyio.sleep(0.01)


async def test_a_1017_byte_nested_frame_kills_neither_prefill_nor_decode(
    tmp_path: anyio.Path,
) -> None:
    assert sum(len(frame) for frame in NESTED_FRAME) == 1019  # 1017 in the four-frame wire
    settings = checked(tmp_path)
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
    settings = checked(tmp_path)
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


def forged_decode(index: int) -> PeerId:
    """A decode rank that does not exist: nothing listens at its address."""
    return PeerId(f"127.0.0.1:{20000 + index}", "forged", 0)


async def test_1100_forged_kv_args_from_distinct_addresses_do_not_exhaust_sockets(
    tmp_path: anyio.Path,
) -> None:
    """Before: each got a reply socket; ZMQ ran out at about 1,020 and the prefill died.
    A reply whose socket ZMQ cannot make yet (its reaper has not freed the slots of the ones
    the pool closed) is refused and counted instead of opening one."""
    settings = checked(tmp_path)
    async with two_nodes(settings) as (p_node, d_node):
        rank = p_node.ranks[0]
        await forge(rank.peer.address, (
            forged_kv_args(d_node, rank.peer, forged_decode(i).address) for i in range(1100)))
        metrics = p_node.runtime.metrics
        limit = settings.control_max_sockets

        def accounted() -> float:
            return metrics.value("pdflow_control_evictions_total", {"what": "socket"}) + (
                metrics.value("pdflow_control_refused_sends_total", {"reason": "connect_failed"})
            )

        with anyio.fail_after(30):
            while accounted() < 1100 - limit:
                await anyio.sleep(0.05)
        assert len(p_node.runtime.sockets) <= limit
        assert await one_room(p_node, d_node, 1) is KVPoll.Success


async def test_1100_forged_aborts_for_rooms_not_opened_open_no_reply_socket(
    tmp_path: anyio.Path,
) -> None:
    """Before: all were parked with no expiry and opened 1,022 reply sockets; the next
    legitimate decode then killed the prefill."""
    settings = checked(tmp_path)
    codec = MsgpackCodec()
    async with two_nodes(settings) as (p_node, d_node):
        rank = p_node.ranks[0]
        sockets = len(p_node.runtime.sockets)
        await forge(rank.peer.address, (
            codec.encode(Abort(1000 + i, 0, forged_decode(i), rank.peer, "forged"), None)
            for i in range(1100)))
        await dropped_at_least(p_node, "unannounced_decode", 1100)
        assert len(p_node.runtime.sockets) == sockets
        assert rank.snapshot().rooms == ()
        assert await one_room(p_node, d_node, 1) is KVPoll.Success


def rss_bytes() -> int:
    """Resident memory in use: freed heap the allocator kept is handed back first."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_40_forged_1mib_room_metadata_do_not_grow_rss(tmp_path: anyio.Path) -> None:
    """Before: +375 MiB of RSS, held for the bootstrap timeout (300 s); 80 such frames here
    grew it by over 600 MiB. Now 40 are dropped unannounced, and of 40 from a decode that
    announced a layout first only one fits the early-page budget (set to 256 Ki pages, all of
    which one decode life may hold here)."""
    settings = checked(tmp_path, control_max_early_pages=1 << 18,
                       control_max_early_pages_per_decode=1 << 18)  # fmt: skip
    codec = MsgpackCodec()
    async with two_nodes(settings) as (p_node, d_node):
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        rank = p_node.ranks[0]
        unannounced, announced = forged_decode(1), forged_decode(2)
        # The second forger announces a layout first, claiming 4 Mi pages.
        layout = packed_layout(base_addr=1 << 20, num_layers=1, num_pages=1 << 22, page_size=1,
                               num_heads=1, head_dim=1, dtype=KvDtype.FP16)  # fmt: skip
        args = KvArgs(announced, rank.peer, "127.0.0.1:1", KvBuffers.from_layout(layout, 1), 1,
                      0, 1)  # fmt: skip
        await forge(rank.peer.address, [codec.encode(args, None)])
        pages = tuple(range(1 << 16, (1 << 16) + 209_000))  # 5 bytes each: just under 1 MiB
        before = rss_bytes()
        for decode in (unannounced, announced):
            def frames(decode: PeerId = decode) -> Iterable[list[bytes]]:
                for room in range(100, 140):
                    yield codec.encode(RoomMetadata(room, 0, decode, rank.peer, "127.0.0.1:1",
                                                    pages, None, 1), None)  # fmt: skip
            await forge(rank.peer.address, frames())
        await dropped_at_least(p_node, "unannounced_decode", 40)
        early = settings.control_max_early_pages // len(pages)
        await dropped_at_least(p_node, "early_pages_limit", 40 - early)
        grown = rss_bytes() - before
        assert grown < 48 << 20, f"RSS grew {grown >> 20} MiB"
        assert await one_room(p_node, d_node, 2) is KVPoll.Success


async def test_one_decode_that_uses_up_its_early_pages_leaves_the_others_theirs(
    tmp_path: anyio.Path,
) -> None:
    """Before: the early-page budget was one per prefill rank; a decode that announced and then
    sent metadata for rooms never opened held it for bootstrap_timeout, and every other
    decode's early metadata was dropped (early_pages_limit): their rooms never started. Now
    each decode life holds at most its share (a quarter unless set: 16 of 64 pages here)."""
    settings = checked(tmp_path, control_max_early_pages=64)
    codec = MsgpackCodec()
    async with two_nodes(settings) as (p_node, d_node):
        hog = forged_decode(1)
        kv = d_node.ranks[0].kv
        for rank in p_node.ranks:
            announce = codec.encode(kv.kv_args(hog, rank.peer, "127.0.0.1:1"), None)
            hoarded = [codec.encode(RoomMetadata(500 + n, 0, hog, rank.peer, "127.0.0.1:1",
                                                 tuple(range(8)), None, 1), None)
                       for n in range(8)]  # fmt: skip
            await forge(rank.peer.address, [announce, *hoarded])
        await dropped_at_least(p_node, "early_pages_share", 6 * len(p_node.ranks))
        # The real decode's metadata arrives before the prefill opens the room: early.
        d_rank, room = d_node.ranks[0], 9
        await d_rank.open(room, 0, p_node.bootstrap)
        await d_rank.wait(room)
        await d_rank.publish_pages(room, [1, 2])
        with anyio.fail_after(10):
            while any(p_node.limits[r.rank].early.pages < 16 + 2 for r in p_node.ranks):
                await anyio.sleep(0.01)  # admitted beside the forger's 16
        for rank in p_node.ranks:
            await rank.open_room(room, 0)
            await rank.wait(room)
            await rank.init_transfer(room, 2)
            await rank.send_chunk(room, [3, 4], True)
        with anyio.fail_after(10):
            assert (await d_rank.wait(room, terminal=True)).poll is KVPoll.Success
        metrics = p_node.runtime.metrics
        assert metrics.value("pdflow_dropped_frames_total", {"reason": "early_pages_limit"}) == 0


async def core_dropped_at_least(node: NodeLifecycle, kind: str, count: int) -> None:
    metrics = node.runtime.metrics
    with anyio.fail_after(20):
        while metrics.value("pdflow_core_dropped_total", {"kind": kind}) < count:
            await anyio.sleep(0.01)


async def test_a_kv_args_accepted_from_a_prefill_never_announced_to_is_dropped(
    tmp_path: anyio.Path,
) -> None:
    settings = checked(tmp_path)
    async with two_nodes(settings) as (p_node, d_node):
        rank = d_node.ranks[0]
        stranger = PeerId("127.0.0.1:1", "forged", 0)
        accepted = KvArgsAccepted(stranger, rank.peer, "127.0.0.1:2")
        await forge(rank.peer.address, [MsgpackCodec().encode(accepted, None)])
        # The core judges the layout handshake (traced): it drops the stranger's answer.
        await core_dropped_at_least(d_node, "unannounced_prefill", 1)
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        assert rank.snapshot().announced_to == len(p_node.ranks)  # the stranger is not kept


async def test_with_the_token_set_a_peer_identity_from_the_registry_no_longer_forges_frames(
    tmp_path: anyio.Path,
) -> None:
    """Before: GET /route gave out (address, incarnation, rank) without a token, and a frame
    naming them was taken as the peer's: a forged ABORT for a room not yet opened failed it."""
    settings = checked(tmp_path, bootstrap_token="cluster-secret")
    async with two_nodes(settings) as (p_node, d_node):
        async with httpx.AsyncClient(base_url=f"http://{p_node.bootstrap}") as http:
            route = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
            assert (await http.get(route)).status_code == 401
        assert await one_room(p_node, d_node, 1) is KVPoll.Success  # the decode announced itself
        decode, rank = d_node.ranks[0].peer, p_node.ranks[0]
        abort = Abort(2, 0, decode, rank.peer, "forged")
        wrong_key = authenticated(MsgpackCodec(), "another-secret", 30.0)
        await forge(rank.peer.address, [MsgpackCodec().encode(abort, None),
                                        wrong_key.encode(abort, None)])
        await dropped_at_least(p_node, "unauthenticated", 1)
        await dropped_at_least(p_node, "bad_mac", 1)
        assert await one_room(p_node, d_node, 2) is KVPoll.Success


async def test_a_forged_1mib_kv_args_is_not_kept(tmp_path: anyio.Path) -> None:
    """Before: the prefill's core kept it (up to control_max_peers of them: 1 GiB encoded).
    Now a layout over control_max_layout_bytes (64 KiB) is dropped, and the real decode's
    layout (well under it) is still kept."""
    settings = checked(tmp_path)
    async with two_nodes(settings) as (p_node, d_node):
        rank = p_node.ranks[0]
        forged = PeerId("127.0.0.1:20001", "forged", 0)
        buffers = tuple(KvBuffer((1 << 40) + i * (1 << 21), 1 << 20, 1 << 10, i, KvRole.K, 1)
                        for i in range(11_500))  # fmt: skip
        args = KvArgs(forged, rank.peer, "127.0.0.1:1", KvBuffers(1, buffers), 1, 0, 1)
        frame = MsgpackCodec().encode(args, None)
        assert len(frame[0]) > 900 << 10
        await forge(rank.peer.address, [frame])
        await core_dropped_at_least(p_node, "layout_too_large", 1)
        assert rank._host.endpoint.layout_of(forged) is None
        assert await one_room(p_node, d_node, 1) is KVPoll.Success


async def test_a_decode_whose_layout_prefills_would_drop_refuses_to_start(
    tmp_path: anyio.Path,
) -> None:
    settings = checked(tmp_path, control_max_layout_bytes=256)
    _cache, kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=32, **GEOMETRY)
    async with InProcessFabric().create_transport() as transport:
        node = DecodeNode(ranks=[kv], transport=transport, settings=settings)
        with pytest.raises(InvalidInput, match="PDFLOW_CONTROL_MAX_LAYOUT_BYTES"):
            async with node:
                pass


@pytest.mark.parametrize("row_bytes", [DEFAULT_SMALL_MESSAGE_BYTES - 64, 70_000])
async def test_a_decode_whose_aux_row_no_success_could_carry_refuses_to_start(
    tmp_path: anyio.Path, row_bytes: int
) -> None:
    """A Success carries the room's aux row in one small message: with a row near or over the
    64 KiB small-message limit every prefill's sender refused each Success, and each room
    waited out waiting_timeout. Now such a decode refuses to start, naming the aux row."""
    settings = checked(tmp_path)
    _cache, kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=32, **GEOMETRY)
    rows = (ctypes.c_uint8 * (2 * row_bytes))()
    kv = msgspec.structs.replace(kv, aux=AuxBuffer.single(ctypes.addressof(rows), row_bytes, 2))
    async with InProcessFabric().create_transport() as transport:
        node = DecodeNode(ranks=[kv], transport=transport, settings=settings)
        with pytest.raises(InvalidInput, match="aux row"):
            async with node:
                pass


async def test_a_decode_whose_aux_row_fits_a_success_starts(tmp_path: anyio.Path) -> None:
    settings = checked(tmp_path)
    _cache, kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=32, **GEOMETRY)
    row_bytes = DEFAULT_SMALL_MESSAGE_BYTES - 2048  # room for the longest ids and addresses
    rows = (ctypes.c_uint8 * (2 * row_bytes))()
    kv = msgspec.structs.replace(kv, aux=AuxBuffer.single(ctypes.addressof(rows), row_bytes, 2))
    async with (
        InProcessFabric().create_transport() as transport,
        DecodeNode(ranks=[kv], transport=transport, settings=settings) as node,
    ):
        assert [rank.kv.aux for rank in node.ranks] == [kv.aux]  # started, serving the row


async def test_a_late_kv_args_of_an_earlier_life_leaves_the_live_layout_in_place(
    tmp_path: anyio.Path,
) -> None:
    """Before: it replaced the live decode life's layout; that life's next RoomMetadata was
    dropped (unannounced_decode) and its room failed. Now the core drops it as a stale life."""
    settings = checked(tmp_path)
    async with two_nodes(settings) as (p_node, d_node):
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        live = d_node.ranks[0].peer
        dead = PeerId(live.address, "an-earlier-life", live.rank)
        kv = d_node.ranks[0].kv
        late = [msgspec.structs.replace(kv.kv_args(dead, rank.peer, "127.0.0.1:1"),
                                        started_at=started_at)
                for rank in p_node.ranks for started_at in (d_node.started_at - 60, None)]
        for rank in p_node.ranks:
            await forge(rank.peer.address, [MsgpackCodec().encode(args, None) for args in late
                                            if args.prefill == rank.peer])  # fmt: skip
        await core_dropped_at_least(p_node, "stale_incarnation", len(late))
        for rank in p_node.ranks:
            assert rank._host.endpoint.layout_of(live) is not None
        assert await one_room(p_node, d_node, 2) is KVPoll.Success
        metrics = p_node.runtime.metrics
        assert metrics.value("pdflow_dropped_frames_total", {"reason": "unannounced_decode"}) == 0


async def test_a_decode_accepts_no_large_frame(tmp_path: anyio.Path) -> None:
    """Large frames only where the protocol needs them: a decode receives no message that
    grows with a room, so its ZMQ cuts a frame over 64 KiB before buffering it (1 MiB of
    forged metadata is never read); smaller frames are dropped before they are decoded."""
    settings = checked(tmp_path)
    async with two_nodes(settings) as (p_node, d_node):
        rank = d_node.ranks[0]
        pull = d_node.runtime.channels[0]._pull
        assert pull.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_SMALL_MESSAGE_BYTES
        pages = tuple(range(1 << 16, (1 << 16) + 209_000))
        forged = RoomMetadata(5, 0, rank.peer, p_node.ranks[0].peer, "x", pages, None, 1)
        await forge(rank.peer.address, [MsgpackCodec().encode(forged, None)] * 10)
        half = b"x" * (DEFAULT_SMALL_MESSAGE_BYTES // 2 + 1)
        await forge(rank.peer.address, [[half, half]] * 3)
        await dropped_at_least(d_node, "malformed", 3)  # one frame per message
        assert await one_room(p_node, d_node, 1) is KVPoll.Success
        metrics = d_node.runtime.metrics
        assert metrics.value("pdflow_dropped_frames_total", {"reason": "oversized"}) == 0
