"""Decode prefix reuse through the real nodes: the decode publishes ``decode_prefix_len`` and
pages only for the rest; the prefill sends only the pages after the prefix, and the decode's
pages (its cached prefix plus what landed) equal the prefill's sequence."""

from __future__ import annotations

import ctypes

import anyio
import pytest

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import HostKvCache, host_cache_for_rank
from pdflow.io.settings import load_settings

from .node_harness import inprocess_room

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL = {"total_kv_heads": 2, "num_layers": 2, "page_size": 4, "head_dim": 8,
         "dtype": KvDtype.FP16, "num_pages": 16}  # fmt: skip
TOKENS = 11  # three pages, the last one partial
PREFIX = 4  # the decode holds the first page


def page_bytes(cache: HostKvCache, page: int) -> bytes:
    """One page in every buffer (K and V of each layer), in buffer order."""
    layout = cache.layout
    return b"".join(ctypes.string_at(layout.page_addr(b, page), layout.item_len)
                    for b in range(len(layout.buffer_addrs)))  # fmt: skip


def copy_page(src: HostKvCache, src_page: int, dst: HostKvCache, dst_page: int) -> None:
    for b in range(len(src.layout.buffer_addrs)):
        ctypes.memmove(dst.layout.page_addr(b, dst_page), src.layout.page_addr(b, src_page),
                       src.layout.item_len)  # fmt: skip


async def transfer(prefix: int, staging: tuple[int, bool] = (0, True)) -> dict[str, object]:
    small_room_bytes, checksum = staging
    settings = load_settings(trace_enabled=False, checksum=checksum,
                             small_room_staging_bytes=small_room_bytes)  # fmt: skip
    p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, **MODEL)  # type: ignore[arg-type]
    src_pages = [5, 9, 2]
    for index, page in enumerate(src_pages):  # distinct bytes per page: a shift shows
        for b in range(len(p_kv.layout.buffer_addrs)):
            ctypes.memset(p_kv.layout.page_addr(b, page), 0x10 + 16 * index + b,
                          p_kv.layout.item_len)  # fmt: skip
    dst_all = [7, 3, 12]
    prefix_pages = prefix // MODEL["page_size"]  # type: ignore[operator]
    for index in range(prefix_pages):  # the decode's cached prefix: it computed these itself
        copy_page(p_cache, src_pages[index], d_cache, dst_all[index])
    async with inprocess_room(p_kv, d_kv, settings) as (p_rank, d_rank):
        try:
            await d_rank.publish_pages(1, dst_all[prefix_pages:], decode_prefix_len=prefix)
        except InvalidInput as exc:
            return {"refused": str(exc), "poll": d_rank.poll(1)}
        await p_rank.wait(1)
        seen_prefix = p_rank.decode_prefix_len(1)
        sent = await p_rank.send_sequence(1, src_pages, num_tokens=TOKENS, chunk_tokens=4)
        status = await d_rank.wait(1, terminal=True)
        nbytes, _ = p_rank.transfer_stats(1)
        await p_rank.wait(1, terminal=True)
    return {
        "poll": status.poll, "reason": status.reason, "sent": sent, "prefix": seen_prefix,
        "bytes": nbytes, "page_bytes": len(page_bytes(p_cache, 0)),
        "equal": [page_bytes(d_cache, d) == page_bytes(p_cache, s)
                  for s, d in zip(src_pages, dst_all, strict=True)],
    }  # fmt: skip


# Direct writes; small-room staging (one write per chunk into the decode's ring, scattered at
# Success) with checksums (scatter on a worker thread) and without (scatter on the loop).
STAGING = [(0, True), (65536, True), (65536, False)]


@pytest.mark.parametrize("staging", STAGING)
def test_the_prefill_sends_only_the_pages_after_the_decodes_prefix(
    staging: tuple[int, bool],
) -> None:
    result = anyio.run(transfer, PREFIX, staging, backend="asyncio")
    assert result["poll"] is KVPoll.Success, result["reason"]
    assert result["prefix"] == PREFIX and result["sent"] == 2
    assert result["bytes"] == 2 * result["page_bytes"], "one page fewer on the wire"
    assert result["equal"] == [True, True, True], "cached prefix + received pages = the sequence"


@pytest.mark.parametrize("staging", STAGING)
def test_without_a_prefix_every_page_is_sent(staging: tuple[int, bool]) -> None:
    result = anyio.run(transfer, 0, staging, backend="asyncio")
    assert result["poll"] is KVPoll.Success, result["reason"]
    assert result["sent"] == 3 and result["bytes"] == 3 * result["page_bytes"]
    assert result["equal"] == [True, True, True]


def test_a_prefix_off_a_page_boundary_is_refused_with_a_reason() -> None:
    result = anyio.run(transfer, 3, backend="asyncio")
    assert "multiple of page_size 4" in str(result["refused"])
    assert result["poll"] is KVPoll.WaitingForInput, "the refused call changed nothing"
