"""The shell's resource bounds: LRU socket pool, early-page budget, admission by layout."""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio

from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import KvDtype, packed_layout
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import Abort, KvArgs, PeerId, RoomMetadata, StatusReport
from pdflow.io.limits import EarlyPages, PrefillRankLimits, SocketPool

PREFILL = PeerId("127.0.0.1:6000", "p", 0)
LAYOUT = KvBuffers.from_layout(
    packed_layout(base_addr=4096, num_layers=1, num_pages=8, page_size=1, num_heads=1,
                  head_dim=1, dtype=KvDtype.FP16), 1
)  # fmt: skip


def decode(n: int, incarnation: str = "d") -> PeerId:
    return PeerId(f"127.0.0.1:{5000 + n}", incarnation, 0)


def kv_args(peer: PeerId) -> KvArgs:
    return KvArgs(peer, PREFILL, "s", LAYOUT, 1, 0, 1)


def test_socket_pool_closes_the_least_recently_used_past_its_limit() -> None:
    context = zmq.asyncio.Context()
    evicted: list[int] = []
    pool = SocketPool(2, on_evict=lambda: evicted.append(1))
    sockets = [context.socket(zmq.PUSH) for _ in range(3)]
    try:
        pool.put(1, "a", sockets[0])
        pool.put(2, "b", sockets[1])
        assert pool.get(1, "a") is sockets[0]  # "b" is now the least recently used
        pool.put(1, "c", sockets[2])
        assert (sockets[1].closed, sockets[0].closed, evicted) == (True, False, [1])
        assert pool.addresses(1) == ("a", "c") and pool.addresses(2) == ()
        assert pool.pop(1, "a") is sockets[0] and len(pool) == 1
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()


def test_early_pages_are_bounded_released_on_open_and_expire() -> None:
    early = EarlyPages(10, hold_s=5.0)
    assert early.admit(1, 6, now=0.0)
    assert not early.admit(2, 5, now=1.0)
    assert early.admit(2, 4, now=1.0) and early.pages == 10
    early.opened(1)
    assert early.pages == 4 and early.admit(3, 6, now=2.0)
    assert not early.admit(4, 1, now=5.9)  # room 2 is held until 6.0
    assert early.admit(4, 4, now=6.0) and early.pages == 10  # rooms 2 expired, 3 and 4 held
    early.opened(99)  # never admitted: nothing to release
    assert early.pages == 10


def test_prefill_rank_admits_only_announced_decodes_and_real_pages() -> None:
    limits = PrefillRankLimits(max_early_pages=4, hold_s=60.0)
    peer = decode(1)
    announced: dict[PeerId, KvArgs] = {}

    def metadata(room: int, pages: tuple[int, ...]) -> RoomMetadata:
        return RoomMetadata(room, 0, peer, PREFILL, "s", pages, None, 1)

    def opened(room: int) -> bool:
        return room == 7

    def refusal(message: object) -> str | None:
        return limits.refusal(message, opened, announced.get, 0.0)

    assert refusal(Abort(1, 0, peer, PREFILL)) == "unannounced_decode"
    assert refusal(metadata(1, (0,))) == "unannounced_decode"
    status = StatusReport(1, 0, KVPoll.Success, PREFILL, peer)
    assert refusal(status) is None  # the core judges the rest
    announced[peer] = kv_args(peer)  # the core keeps what decodes announced
    assert refusal(Abort(1, 0, peer, PREFILL)) is None
    assert refusal(metadata(1, (0, 8))) == "pages_out_of_range"
    assert refusal(metadata(1, (-1,))) == "pages_out_of_range"
    assert refusal(metadata(1, (0, 1, 2))) is None
    assert refusal(metadata(2, (3, 4))) == "early_pages_limit"
    assert refusal(metadata(7, tuple(range(8)))) is None  # open: no budget


@pytest.mark.parametrize("limit", [0, -1])
def test_limits_must_be_positive(limit: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SocketPool(limit)
    with pytest.raises(ValueError, match="at least 1"):
        EarlyPages(limit, 1.0)
