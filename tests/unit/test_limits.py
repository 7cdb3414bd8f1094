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
    early = EarlyPages(10, hold_s=5.0, per_decode=10)
    d = decode(1)
    assert early.admit(1, d, 6, now=0.0) is None
    assert early.admit(2, d, 5, now=1.0) == "early_pages_limit"
    assert early.admit(2, d, 4, now=1.0) is None and early.pages == 10
    early.opened(1)
    assert early.pages == 4 and early.admit(3, d, 6, now=2.0) is None
    assert early.admit(4, d, 1, now=5.9) == "early_pages_limit"  # room 2 is held until 6.0
    assert early.admit(4, d, 4, now=6.0) is None and early.pages == 10  # 2 expired; 3, 4 held
    early.opened(99)  # never admitted: nothing to release
    assert early.pages == 10


def test_one_decode_life_cannot_use_up_the_early_pages_of_the_others() -> None:
    """Before: one budget for every decode life; one that used it up had every other decode's
    early metadata dropped for bootstrap_timeout. Now each holds at most its share."""
    early = EarlyPages(10, hold_s=5.0, per_decode=4)
    hog, other, restarted = decode(1), decode(2), decode(1, incarnation="d2")
    assert early.admit(1, hog, 3, now=0.0) is None
    assert early.admit(2, hog, 2, now=0.0) == "early_pages_share"  # 5 > its share of 4
    assert early.admit(2, hog, 1, now=0.0) is None
    assert early.admit(3, hog, 1, now=0.0) == "early_pages_share"
    assert early.admit(3, other, 4, now=0.0) is None  # its own share is untouched
    assert early.admit(1, restarted, 2, now=0.0) is None  # another life: another share
    assert early.pages == 10 and early.admit(4, decode(3), 1, 0.0) == "early_pages_limit"
    early.opened(1)  # room 1 held 3 of the hog's pages and 2 of the restarted life's
    assert early.pages == 5
    assert early.admit(5, hog, 3, now=1.0) is None  # 1 + 3: its whole share again
    assert early.admit(6, restarted, 2, now=1.0) is None and early.pages == 10
    assert early.admit(7, other, 1, now=4.9) == "early_pages_limit"
    assert early.admit(7, other, 4, now=5.0) is None  # rooms 2 and 3 expired, and its pages
    assert early.admit(8, hog, 1, now=5.0) is None  # room 2's page expired: its share has one
    early.opened(7)
    assert early.pages == 6 and early.admit(9, hog, 1, now=5.0) == "early_pages_share"
    assert EarlyPages(10, hold_s=5.0).per_decode == 2  # unless set: a quarter


def test_prefill_rank_admits_only_announced_decodes_and_real_pages() -> None:
    limits = PrefillRankLimits(max_early_pages=4, hold_s=60.0, max_early_pages_per_decode=4)
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
    share = PrefillRankLimits(max_early_pages=4, hold_s=60.0, max_early_pages_per_decode=2)
    assert share.refusal(metadata(1, (0, 1, 2)), opened, announced.get, 0.0) == (
        "early_pages_share"
    )
    assert refusal(metadata(7, tuple(range(8)))) is None  # open: no budget


@pytest.mark.parametrize("limit", [0, -1])
def test_limits_must_be_positive(limit: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SocketPool(limit)
    with pytest.raises(ValueError, match="at least 1"):
        EarlyPages(limit, 1.0)
