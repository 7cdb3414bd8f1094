"""``GET /metrics`` on both nodes, scraped over HTTP and parsed with prometheus_client's parser.

One room succeeds; a second is aborted while its write is held in flight, so its pages stay
quarantined until the prefill's drain ACK (the in-process fabric without a receiver fence, as
Mooncake): the decode's scrape shows them quarantined, and its request still admitted (its
pages out of the pool admission sees) until they are released.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdflow.core.dataplane.layout import KvDtype
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.kv_buffers import host_cache_for_rank
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from pdflow.transport import InProcessFabric

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(60)]

GEOMETRY: dict[str, Any] = {"num_layers": 2, "page_size": 4, "head_dim": 8, "total_kv_heads": 4,
            "dtype": KvDtype.FP16}  # fmt: skip
TOKEN = "metrics-test-token"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def scrape(address: str | None, **headers: str) -> dict[str, float]:
    """Every sample of the node's /metrics, as ``name{label=value,...}`` -> value."""
    assert address is not None, "the node serves no /metrics"
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://{address}/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        samples[f"family:{family.name}"] = 1.0
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


async def test_both_nodes_serve_prometheus_metrics_over_http(tmp_path: anyio.Path) -> None:
    settings = load_settings(env={}, trace_dir=str(tmp_path), metrics_port=0,
                             bootstrap_token=TOKEN)  # fmt: skip
    auth = {"Authorization": f"Bearer {TOKEN}"}
    fabric = InProcessFabric(receiver_fence=False)
    _p_cache, p_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=16, **GEOMETRY)
    _d_cache, d_kv = host_cache_for_rank(tp_size=1, tp_rank=0, num_pages=16, **GEOMETRY)
    async with (
        fabric.create_transport() as p_transport, fabric.create_transport() as d_transport,
        PrefillNode(ranks=[p_kv], transport=p_transport, bootstrap="127.0.0.1:0",
                    settings=settings) as p_node,
        DecodeNode(ranks=[d_kv], transport=d_transport, settings=settings,
                   admission_reserve_tokens=0) as d_node,
    ):  # fmt: skip
        d_rank, p_rank = d_node.ranks[0], p_node.ranks[0]
        # Room 1 succeeds.
        await p_rank.open_room(1, 0)
        await d_rank.open(1, 0, p_node.bootstrap)
        await d_rank.wait(1)
        assert await d_rank.admit(1, input_len=8, max_new=0) == 2
        await d_rank.publish_pages(1, [0, 1])
        await p_rank.wait(1)
        await p_rank.init_transfer(1, 2)
        await p_rank.send_chunk(1, [0, 1], True)
        assert (await d_rank.wait(1, terminal=True)).poll is KVPoll.Success
        await d_rank.clear(1)
        d_rank.finish_request(1, 0)
        assert (await p_rank.wait(1, terminal=True)).poll is KVPoll.Success
        await p_rank.clear(1)
        # Room 2: aborted while its write is held in flight, so its pages are quarantined.
        await p_rank.open_room(2, 0)
        await d_rank.open(2, 0, p_node.bootstrap)
        await d_rank.wait(2)
        await d_rank.admit(2, input_len=8, max_new=0)
        hold = fabric.hold_writes(d_transport.session_id)
        await d_rank.publish_pages(2, [2, 3])
        await p_rank.wait(2)
        await p_rank.init_transfer(2, 2)
        await p_rank.send_chunk(2, [2, 3], True)
        with anyio.fail_after(5):
            await hold.wait_for_writer()
        await d_rank.abort(2, "the client went away")
        assert (await d_rank.wait(2, terminal=True)).poll is KVPoll.Failed
        await d_rank.clear(2)

        decode = await scrape(d_node.metrics_address, **auth)
        assert decode["pdflow_rooms_total{outcome=success}"] == 1
        assert decode["pdflow_rooms_total{outcome=failed}"] == 1
        assert decode["pdflow_quarantined_pages{}"] == 2
        assert decode["pdflow_quarantine_oldest_age_seconds{}"] >= 0
        assert decode["pdflow_allocation_wait_seconds_count{}"] == 2
        assert decode["pdflow_admission_admitted{}"] == 1, "a quarantined room's pages count"
        assert decode["pdflow_admission_queued{}"] == 0
        assert "family:pdflow_dropped_frames" in decode

        hold.release()
        with anyio.fail_after(5):
            while d_rank.allocatable != 16:  # the drain ACK frees the pages
                await anyio.sleep(0.01)
        decode = await scrape(d_node.metrics_address, **auth)
        assert decode["pdflow_quarantined_pages{}"] == 0
        assert decode["pdflow_admission_admitted{}"] == 0

        prefill = await scrape(p_node.metrics_address, **auth)
        assert prefill["pdflow_rooms_total{outcome=success}"] == 1
        assert prefill["pdflow_bytes_moved_total{}"] == 2 * p_kv.layout.item_len * 2 * 2
        assert prefill["pdflow_room_transfer_seconds_count{}"] >= 1
        assert "family:pdflow_dropped_frames" in prefill

        async with httpx.AsyncClient() as client:
            base = f"http://{d_node.metrics_address}"
            assert (await client.get(f"{base}/metrics")).status_code == 401
            assert (await client.get(f"{base}/metrics", headers={"X-Pdflow-Token": "no"})
                    ).status_code == 401  # fmt: skip
            missing = await client.get(f"{base}/nothing", headers=auth)
            assert missing.status_code == 404
            assert "/metrics" in missing.text
            assert (await client.post(f"{base}/metrics", headers=auth)).status_code == 405


async def test_idle_connections_and_bad_heads_never_turn_the_scraper_away() -> None:
    """Eight idle connections, no token needed, held every scrape slot (503 for everyone); a
    head over the size bound read in one piece was served; an empty X-Pdflow-Token hid a
    valid bearer token."""
    from pdflow.io.metrics_http import (
        MAX_READING,
        MAX_REQUEST_HEAD,
        MetricsServer,
        open_metrics_listener,
    )

    server = MetricsServer(lambda: "pdflow_up 1\n", TOKEN)
    listener, address = await open_metrics_listener("127.0.0.1", 0)
    host, port = address.rsplit(":", 1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(listener.serve, server.handle)
        idle = [await anyio.connect_tcp(host, int(port)) for _ in range(MAX_READING + 16)]
        async with httpx.AsyncClient() as client:
            with anyio.fail_after(2):  # well before the idle ones' head deadline
                scraped = await client.get(f"http://{address}/metrics", headers=auth)
            assert (scraped.status_code, scraped.text) == (200, "pdflow_up 1\n")
            empty_token = await client.get(f"http://{address}/metrics",
                                           headers={**auth, "X-Pdflow-Token": ""})  # fmt: skip
            assert empty_token.status_code == 200
            big = await client.get(f"http://{address}/metrics",
                                   headers={**auth, "X-Pad": "p" * (MAX_REQUEST_HEAD + 800)})
            assert big.status_code == 431
        for stream in idle:
            await stream.aclose()
        tasks.cancel_scope.cancel()
