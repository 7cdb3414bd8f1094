"""The HTTP bootstrap server and client over loopback: SGLang's transcript, refusals, start-up
races, restarts, and the `pdflow bootstrap` command."""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

from pdflow.core.cluster.registry import PrefillServerInfo
from pdflow.io.bootstrap_client import (
    BootstrapClient,
    BootstrapError,
    BootstrapUnavailable,
    RankNotFound,
    RetryPolicy,
)
from pdflow.io.bootstrap_server import RunningBootstrap, serve
from tests.unit.test_registry_support import rank

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
INCARNATION = "X-Pdflow-Incarnation"
TOPOLOGY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
JSON = {"Content-Type": "application/json"}
FAST = RetryPolicy(attempts=40, base_s=0.01, cap_s=0.05)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sglang_body(tp: int, port: int, **overrides: Any) -> dict[str, Any]:
    """A registration exactly as SGLang's prefill sends it (transcript, section 6)."""
    body: dict[str, Any] = {
        "attn_tp_size": 2, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
        "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port, "page_size": 1,
        "kv_cache_dtype": "auto", "kv_layout": None, "dsv41_spec_layout": None,
        "load_balance_method": "follow_bootstrap_room", "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "prefill_http_port": 30000,
        "decode_allocation_policy": "early",
    }
    body.update(overrides)
    return body


def rank_path(dp: int, cp: int, tp: int, pp: int) -> str:
    return (f"/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}"
            f"&target_pp_rank={pp}")


@asynccontextmanager
async def server_and_http(**options: Any) -> AsyncIterator[tuple[RunningBootstrap,
                                                                httpx.AsyncClient]]:
    async with (
        serve("127.0.0.1", 0, **options) as server,
        httpx.AsyncClient(base_url=server.url, timeout=5.0) as http,
    ):
        yield server, http


def expect(response: httpx.Response, status: int, text: str | None = None) -> None:
    assert response.status_code == status, response.text
    if text is not None:
        assert response.text == text
        assert response.headers["content-type"].startswith("text/plain")


# ---- SGLang's transcript, step by step ----------------------------------------------------------
@pytest.mark.anyio
async def test_sglang_transcript() -> None:
    async with server_and_http() as (_, http):
        expect(await http.get("/health"), 200, "OK")
        not_ready = "Prefill server not fully registered yet ({} workers registered)."
        expect(await http.get(TOPOLOGY), 503, not_ready.format(0))
        expect(await http.get(rank_path(0, 0, 0, 0)), 503, not_ready.format(0))
        missing = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
        expect(await http.get(missing), 400, "Missing inputs for bootstrap server.")
        expect(await http.post("/route", json=sglang_body(0, 40001)), 405, "Method not allowed")
        expect(await http.put("/route", json=sglang_body(0, 40001)), 200, "OK")
        expect(await http.get(TOPOLOGY), 503, not_ready.format(1))
        policy = sglang_body(1, 40002, decode_allocation_policy="prefill_complete")
        response = await http.put("/route", json=policy)
        expect(response, 400)
        assert response.text.startswith("Inconsistent prefill allocation policies")
        layout = sglang_body(1, 40002, dsv41_spec_layout={"block_size": 4})
        response = await http.put("/route", json=layout)
        expect(response, 400)
        assert response.text.startswith(
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks")
        no_ip = sglang_body(1, 40002)
        del no_ip["rank_ip"]
        response = await http.put("/route", json=no_ip)  # SGLang: 500
        expect(response, 400)
        assert "rank_ip" in response.text
        expect(await http.put("/route", json=sglang_body(1, 40002)), 200, "OK")
        response = await http.get(TOPOLOGY)
        expect(response, 200)
        assert response.headers["content-type"] == "application/json"
        assert response.json() == {
            "attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 1,
            "kv_cache_dtype": "auto", "follow_bootstrap_room": True,
            "enable_dsa_cache_layer_split": False, "decode_allocation_policy": "early",
            "enable_kv_cache_sharding": False, "prefill_http_port": 30000,
            "target_tp_rank": None, "target_tp_ranks": None, "target_cp_ranks": None,
            "target_pp_ranks": None, "required_dst_info_num": None,
            "required_prefill_response_num": None,
        }
        response = await http.get(rank_path(0, 0, 1, 0))
        expect(response, 200)
        assert response.json() == {"rank_ip": "127.0.0.1", "rank_port": 40002}
        expect(await http.get(rank_path(0, 0, 5, 0)), 404,
               "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=5 pp_rank=0")
        room = {"bootstrap_room": 123456789, "dp_rank": 0}
        expect(await http.post("/register_dp_rank", json=room), 200, "OK")
        response = await http.post("/query_dp_ranks", json={"bootstrap_rooms": [123456789, 42]})
        expect(response, 200)
        assert response.json() == {"123456789": 0}
        expect(await http.get("/nope"), 404, "404: Not Found")


@pytest.mark.anyio
async def test_duplicate_registration_does_not_make_the_server_ready() -> None:
    """Transcript phase 2, where SGLang wrongly reports ready: pdflow counts distinct ranks."""
    async with server_and_http() as (_, http):
        expect(await http.put("/route", json=sglang_body(0, 40001)), 200, "OK")
        expect(await http.put("/route", json=sglang_body(0, 40003)), 200, "OK")
        expect(await http.get(TOPOLOGY), 503,
               "Prefill server not fully registered yet (1 workers registered).")
        expect(await http.get(rank_path(0, 0, 0, 0)), 503)
        expect(await http.put("/route", json=sglang_body(1, 40002)), 200, "OK")
        assert (await http.get(rank_path(0, 0, 0, 0))).json()["rank_port"] == 40003


# ---- refusals -----------------------------------------------------------------------------
@pytest.mark.anyio
async def test_token_required_for_everything_but_health() -> None:
    async with server_and_http(token=TOKEN) as (server, http):
        empty = server.registry.snapshot()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Pdflow-Token": "wrong"},
                        {"Authorization": f"Basic {TOKEN}"}):
            response = await http.put("/route", json=sglang_body(0, 40001), headers=headers)
            expect(response, 401)
            assert "PDFLOW_BOOTSTRAP_TOKEN" in response.text
            room = {"bootstrap_room": 1, "dp_rank": 0}
            expect(await http.post("/register_dp_rank", json=room, headers=headers), 401)
            # Reads reveal the prefill's control endpoints (all a forger needed).
            expect(await http.get(TOPOLOGY, headers=headers), 401)
            expect(await http.get(rank_path(0, 0, 0, 0), headers=headers), 401)
            query = {"bootstrap_rooms": [1]}
            expect(await http.post("/query_dp_ranks", json=query, headers=headers), 401)
        # A body cannot carry the token for itself.
        response = await http.put("/route", json=sglang_body(0, 40001, token=TOKEN))
        expect(response, 401)
        assert server.registry.snapshot() == empty
        expect(await http.get(TOPOLOGY, headers={"X-Pdflow-Token": TOKEN}), 503)
        expect(await http.get("/health"), 200, "OK")
        expect(await http.put("/route", json=sglang_body(0, 40001),
                              headers={"Authorization": f"Bearer {TOKEN}"}), 200, "OK")
        expect(await http.put("/route", json=sglang_body(1, 40002),
                              headers={"X-Pdflow-Token": TOKEN}), 200, "OK")
        expect(await http.get(TOPOLOGY, headers={"Authorization": f"Bearer {TOKEN}"}), 200)


@pytest.mark.anyio
async def test_oversized_bodies_get_413() -> None:
    async with server_and_http(max_body=1024) as (server, http):
        big = sglang_body(0, 40001, padding="x" * 2000)
        expect(await http.put("/route", json=big), 413)
        expect(await http.post("/query_dp_ranks", json={"bootstrap_rooms": list(range(500))}),
               413)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while read
            for _ in range(8):
                yield b" " * 200

        response = await http.put("/route", content=chunks(), headers=JSON)
        expect(response, 413)
        assert "limit of 1024 bytes" in response.text
        assert server.registry.snapshot().first is None
        expect(await http.put("/route", json=sglang_body(0, 40001)), 200, "OK")


MALFORMED: list[tuple[str, str, dict[str, Any], str]] = [
    ("PUT", "/route", {"content": b"{not json"}, "Malformed JSON body"),
    ("PUT", "/route", {"content": b"[1, 2]"}, "must be a JSON object"),
    ("PUT", "/route", {"json": sglang_body(0, 40001, attn_tp_size="2")},
     "Expected `int`, got `str` - at `$.attn_tp_size`"),
    ("PUT", "/route", {"json": sglang_body(0, 40001, decode_allocation_policy="late")},
     "decode_allocation_policy"),
    ("PUT", "/route", {"json": sglang_body(0, 40001, rank_port=2**70)}, "rank_port"),
    ("PUT", "/route", {"json": sglang_body(0, 40001, type="QueryTopology", rank_port=0)},
     "rank_port=0"),
    ("PUT", "/route", {"json": sglang_body(5, 40001)}, "attn_tp_rank=5"),
    ("GET", rank_path(0, 0, 0, 0).replace("target_tp_rank=0", "target_tp_rank=x"), {},
     "target_tp_rank='x' is not an integer"),
    ("GET", rank_path(0, 0, 0, 0).replace("target_pp_rank=0", "target_pp_rank="), {},
     "Missing inputs for bootstrap server."),
    ("POST", "/register_dp_rank", {"json": {"bootstrap_room": "1", "dp_rank": 0}},
     "Malformed dp rank registration"),
    ("POST", "/register_dp_rank", {"json": {"dp_rank": 0}}, "bootstrap_room"),
    ("POST", "/register_dp_rank", {"json": {"bootstrap_room": 1, "dp_rank": -2}}, "dp_rank=-2"),
    ("POST", "/query_dp_ranks", {"json": {"bootstrap_rooms": 5}}, "Malformed dp rank query"),
    ("POST", "/query_dp_ranks", {"content": b""}, "Malformed JSON body"),
]


@pytest.mark.anyio
async def test_malformed_requests_get_400_and_change_nothing() -> None:
    async with server_and_http() as (server, http):
        expect(await http.put("/route", json=sglang_body(0, 40001)), 200, "OK")
        for method, path, request_kw, needle in MALFORMED:
            before = server.registry.snapshot()
            response = await http.request(method, path, headers=JSON, **request_kw)
            assert (response.status_code, needle in response.text) == (400, True), (
                f"{method} {path} {request_kw}: {response.status_code} {response.text}")
            assert server.registry.snapshot() == before, f"{method} {path} changed the registry"
        expect(await http.get("/health"), 200, "OK")
        expect(await http.put("/route", json=sglang_body(1, 40002)), 200, "OK")


@pytest.mark.anyio
async def test_wrong_methods_get_405() -> None:
    async with server_and_http() as (_, http):
        for method, path in (("DELETE", "/route"), ("POST", "/route"), ("PATCH", "/route"),
                             ("GET", "/register_dp_rank"), ("GET", "/query_dp_ranks"),
                             ("POST", "/health")):
            expect(await http.request(method, path), 405, "Method not allowed")


# ---- the client -------------------------------------------------------------------------------
class SleepRecorder:
    """Records the client's backoff delays and sleeps a token amount of real time."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await anyio.sleep(min(delay, 0.02))


def free_unlistened_socket() -> socket.socket:
    """Bound but not listening: connecting to it is refused until the server takes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.anyio
async def test_query_before_the_server_binds_retries_then_succeeds() -> None:
    sock = free_unlistened_socket()
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    sleeps = SleepRecorder()
    found: list[PrefillServerInfo] = []
    async with BootstrapClient(address, rng=random.Random(1), retry=FAST, sleep=sleeps) as dec:

        async def decode_side() -> None:
            found.append(await dec.get_topology(deadline_s=20.0))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(decode_side)
            await anyio.sleep(0.3)
            refused_so_far = len(sleeps.delays)
            async with serve(sock=sock) as server, BootstrapClient(
                server.address, rng=random.Random(2)
            ) as prefill:
                await anyio.sleep(0.1)  # decode now gets 503 instead of refused
                for tp in (0, 1):
                    await prefill.register_rank(rank(tp))
                with anyio.fail_after(10):
                    while not found:
                        await anyio.sleep(0.01)
    assert refused_so_far >= 2 and len(sleeps.delays) > refused_so_far
    assert found[0].attn_tp_size == 2 and found[0].dp_size == 1


@pytest.mark.anyio
async def test_registration_before_the_server_binds_retries_then_succeeds() -> None:
    sock = free_unlistened_socket()
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    sleeps = SleepRecorder()
    async with (
        BootstrapClient(address, rng=random.Random(3), retry=FAST, sleep=sleeps) as cl,
        anyio.create_task_group() as tasks,
    ):
        tasks.start_soon(cl.register_rank, rank(0, tp_size=1))
        await anyio.sleep(0.3)
        async with serve(sock=sock) as server:
            with anyio.fail_after(10):
                while server.registry.snapshot().first is None:
                    await anyio.sleep(0.01)
            topology = await cl.get_topology(deadline_s=5.0)
    assert len(sleeps.delays) >= 2
    assert topology.attn_tp_size == 1


@pytest.mark.anyio
async def test_restarted_rank_is_seen_with_its_new_incarnation() -> None:
    async with serve(port=0, incarnation="registry-1") as server, BootstrapClient(
        server.address, rng=random.Random(4)
    ) as client:
        await client.register_rank(rank(0, incarnation="p0-a", protocol_version=1))
        await client.register_rank(rank(1, incarnation="p1-a", protocol_version=1))
        first = await client.get_rank(0, 0, 0, 0)
        assert (first.incarnation, first.rank_port) == ("p0-a", 40001)
        await client.register_rank(rank(0, port=41001, incarnation="p0-b", protocol_version=1))
        again = await client.get_rank(0, 0, 0, 0)
        assert (again.incarnation, again.rank_port, again.protocol_version) == (
            "p0-b", 41001, 1)
        assert (await client.get_topology()).attn_tp_size == 2
        assert len(server.registry.snapshot().ranks) == 2


@pytest.mark.anyio
async def test_finding4_late_put_from_a_dead_incarnation_gets_409_over_http() -> None:
    """Issue 12, finding 4: with the registry hosted by the new process, a late PUT of the dead
    one used to get 200 and replace the live ranks, so /health and the topology disagreed."""
    def body(tp: int, port: int, incarnation: str, started_at: float) -> dict[str, Any]:
        return sglang_body(tp, port, incarnation=incarnation, started_at=started_at)

    async with server_and_http(incarnation="p-live") as (server, http):
        for tp in (0, 1):
            expect(await http.put("/route", json=body(tp, 40001 + tp, "p-dead", 1000.0)), 200)
        for tp in (0, 1):
            expect(await http.put("/route", json=body(tp, 41001 + tp, "p-live", 1010.0)), 200)
        before = server.registry.snapshot()
        late = await http.put("/route", json=body(0, 40001, "p-dead", 1000.0))
        expect(late, 409)
        assert late.text.startswith("Superseded registration") and "p-dead" in late.text
        assert server.registry.snapshot() == before
        health = await http.get("/health")
        ranks = [(await http.get(rank_path(0, 0, tp, 0))).json() for tp in (0, 1)]
        assert {r["incarnation"] for r in ranks} == {health.headers[INCARNATION]} == {"p-live"}
        assert [r["rank_port"] for r in ranks] == [41001, 41002]
    async with serve(port=0) as server, BootstrapClient(server.address,
                                                        rng=random.Random(8)) as client:
        await client.register_rank(rank(0, incarnation="p-new", started_at=20.0))
        with pytest.raises(BootstrapError, match="is older than incarnation p-new") as older:
            await client.register_rank(rank(0, port=40009, incarnation="p-old", started_at=10.0))
        assert older.value.status == 409


@pytest.mark.anyio
async def test_a_restarted_prefill_is_answered_with_its_new_settings_over_http() -> None:
    """Before: the topology kept the dead life's HTTP port and load balance method, and an
    upgraded restart (another protocol_version) got 400 for good."""
    def body(tp: int, life: str, started_at: float, **changed: Any) -> dict[str, Any]:
        return sglang_body(tp, 40001 + tp, incarnation=life, started_at=started_at,
                           **{"protocol_version": 3, **changed})

    async with server_and_http() as (_, http):
        for tp in (0, 1):
            expect(await http.put("/route", json=body(tp, "p-a", 100.0)), 200, "OK")
        for tp in (0, 1):
            restarted = body(tp, "p-b", 200.0, prefill_http_port=31000,
                             load_balance_method="round_robin")
            expect(await http.put("/route", json=restarted), 200, "OK")
        topology = (await http.get(TOPOLOGY)).json()
        assert (topology["prefill_http_port"], topology["follow_bootstrap_room"]) == (31000, False)
        for tp in (0, 1):
            upgraded = body(tp, "p-c", 300.0, prefill_http_port=31000,
                            load_balance_method="round_robin", protocol_version=4)
            expect(await http.put("/route", json=upgraded), 200, "OK")
        assert (await http.get(rank_path(0, 0, 1, 0))).json()["protocol_version"] == 4
        late = await http.put("/route", json=body(0, "p-a", 100.0))
        expect(late, 409)


@pytest.mark.anyio
async def test_client_errors_are_clear_and_not_retried() -> None:
    async with serve(port=0, token=TOKEN) as server:
        sleeps = SleepRecorder()
        async with BootstrapClient(server.address, rng=random.Random(5), sleep=sleeps) as anon:
            with pytest.raises(BootstrapError) as info:
                await anon.register_rank(rank(0))
            assert info.value.status == 401 and "PDFLOW_BOOTSTRAP_TOKEN" in str(info.value)
            assert sleeps.delays == []
            with pytest.raises(BootstrapError) as read:
                await anon.get_topology(deadline_s=0.2)
            assert read.value.status == 401 and sleeps.delays == []
        async with BootstrapClient(server.address, rng=random.Random(6), token=TOKEN) as client:
            with pytest.raises(BootstrapError, match="attn_tp_rank=7") as bad:
                await client.register_rank(rank(7))
            assert bad.value.status == 400
            await client.register_rank(rank(0))
            await client.register_rank(rank(1))
            with pytest.raises(RankNotFound, match="tp_rank=5"):
                await client.get_rank(0, 0, 5, 0)
            await client.register_dp_rank(77, 0)
            assert await client.query_dp_ranks([77, 78]) == {77: 0}


@pytest.mark.anyio
async def test_backoff_jitter_is_deterministic_per_seed() -> None:
    sock = free_unlistened_socket()  # refuses every connection
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    policy = RetryPolicy(attempts=5, base_s=0.01, cap_s=0.04)
    runs = []
    for _ in range(2):
        sleeps = SleepRecorder()
        async with BootstrapClient(address, rng=random.Random(42), retry=policy,
                                   sleep=sleeps) as client:
            with pytest.raises(BootstrapUnavailable, match="after 5 attempts"):
                await client.register_rank(rank(0))
        runs.append(sleeps.delays)
    sock.close()
    reference = random.Random(42)
    assert runs[0] == runs[1] == [policy.delay(n, reference) for n in range(4)]
    for n, delay in enumerate(runs[0]):
        ceiling = min(0.01 * 2**n, 0.04)
        assert 0.75 * ceiling <= delay <= ceiling


@pytest.mark.anyio
async def test_health_and_topology_cache_follow_the_incarnation() -> None:
    async with serve(port=0, incarnation="inc-1") as server:
        address = server.address
        client = BootstrapClient(address, rng=random.Random(7), retry=FAST)
        health = await client.health()
        assert (health.ok, health.incarnation) == (True, "inc-1")
        for tp in (0, 1):
            await client.register_rank(rank(tp))
        info = await client.topology(health.incarnation)
    # The server is gone: the cached topology of inc-1 still answers, without the network.
    assert await client.topology("inc-1") is info
    down = await client.health()
    assert not down.ok and down.incarnation is None and down.detail
    with pytest.raises(BootstrapUnavailable):
        await client.topology("inc-2", deadline_s=0.1)
    client.forget_topology()
    with pytest.raises(BootstrapUnavailable):
        await client.topology("inc-1", deadline_s=0.1)
    await client.aclose()


@pytest.mark.anyio
async def test_periodic_tick_expires_room_entries() -> None:
    clock = [0.0]
    async with server_and_http(dp_rank_ttl=120.0, tick_interval=0.02,
                               clock=lambda: clock[0]) as (server, http):
        expect(await http.post("/register_dp_rank", json={"bootstrap_room": 9, "dp_rank": 0}),
               200, "OK")
        await anyio.sleep(0.1)
        assert len(server.registry.snapshot().room_dp_ranks) == 1
        clock[0] = 120.0
        with anyio.fail_after(5):
            while server.registry.snapshot().room_dp_ranks:
                await anyio.sleep(0.01)
        assert (await http.post("/query_dp_ranks", json={"bootstrap_rooms": [9]})).json() == {}


@pytest.mark.anyio
async def test_shutdown_leaves_no_task_and_frees_the_port() -> None:
    tasks_before = len(asyncio.all_tasks())
    async with serve(port=0) as server, httpx.AsyncClient(base_url=server.url) as http:
        expect(await http.get("/health"), 200, "OK")
        port = server.port
    assert len(asyncio.all_tasks()) == tasks_before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    socket.create_server(("127.0.0.1", port)).close()  # the port is free again


@pytest.mark.anyio
async def test_cancelling_the_caller_still_shuts_down_cleanly() -> None:
    tasks_before = len(asyncio.all_tasks())
    with anyio.move_on_after(0.2):
        async with serve(port=0) as server:
            port = server.port
            await anyio.sleep(10)
    assert len(asyncio.all_tasks()) == tasks_before
    socket.create_server(("127.0.0.1", port)).close()


# ---- the command ----------------------------------------------------------------------------
def _start_command(env_extra: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, **env_extra}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pdflow.cli import main; sys.exit(main())",
         "bootstrap", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready:
        proc.kill()
        pytest.fail("pdflow bootstrap printed no address within 30 s")
    line = proc.stdout.readline().strip()
    assert line.startswith("pdflow bootstrap listening on http://127.0.0.1:"), line
    return proc, line.rsplit(" ", 1)[1]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_bootstrap_command_serves_and_stops_on_signal(stop: signal.Signals) -> None:
    proc, url = _start_command({"PDFLOW_BOOTSTRAP_TOKEN": TOKEN})
    try:
        health = httpx.get(f"{url}/health", timeout=5)
        # A registry standing apart reports no incarnation unless given one (--incarnation).
        assert health.text == "OK" and health.headers.get("x-pdflow-incarnation") is None
        assert httpx.put(f"{url}/route", json=sglang_body(0, 40001), timeout=5).status_code == 401
        proc.send_signal(stop)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stderr is not None
    log = proc.stderr.read()
    assert '"event": "bootstrap_stopping"' in log and '"status": 401' in log


def test_bootstrap_command_reports_a_bad_setting() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from pdflow.cli import main; sys.exit(main())",
         "bootstrap", "--port", "0"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PDFLOW_BOOTSTRAP_MAX_BODY": "lots"},
    )
    assert result.returncode == 2
    assert "PDFLOW_BOOTSTRAP_MAX_BODY='lots'" in result.stderr
