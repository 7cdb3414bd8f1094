"""Liveness with real processes on loopback: an external ``pdflow bootstrap`` registry, prefill
processes that do not host it, kill -9, and a dead incarnation's late registration.

Issue 12, findings 4 and 5: behind an external registry the decode probed only the registry's
``/health``, so a prefill killed with -9 was never noticed (its rooms failed only at
``waiting_timeout``, 300 s by default); and a late PUT of the dead incarnation got 200 and took
its ranks back from the live one.
"""

from __future__ import annotations

import asyncio
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import anyio
import httpx
import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.node_common import RoomStatus
from pdflow.transport.mooncake import MooncakeTransport

from .node_harness import (
    decode_engine,
    prefill_process,
    stall_then_kill,
    start_rooms,
    wait_readmitted,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(120)]

HEARTBEAT_S, MAX_FAILURES = 0.5, 2
TOPOLOGY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
RANK_0 = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextmanager
def external_registry() -> Iterator[str]:
    """``pdflow bootstrap`` in its own process; yields its ``host:port``."""
    command = [sys.executable, "-c", "import sys; from pdflow.cli import main; sys.exit(main())",
               "bootstrap", "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    # Its log (stderr) is not read here: discarded, so a full pipe can never stall it.
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 30)
        assert ready, "pdflow bootstrap printed no address within 30 s"
        url = process.stdout.readline().strip().rsplit(" ", 1)[1]
        yield url.removeprefix("http://")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def late_registration(ready: dict[str, Any], topology: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's registration as the (now dead) prefill process sent it."""
    ip, _, port = ready["ranks"][0].rpartition(":")
    return {
        "attn_tp_size": topology["attn_tp_size"], "attn_tp_rank": 0, "attn_cp_size": 1,
        "attn_cp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": ip, "rank_port": int(port),
        "page_size": topology["page_size"], "kv_cache_dtype": topology["kv_cache_dtype"],
        "incarnation": ready["incarnation"], "started_at": ready["started_at"],
        "health": ready["health"], "checksum": True,
    }


async def test_finding5_external_registry_kill_9_is_noticed_and_a_late_put_gets_409(
    tmp_path: anyio.Path,
) -> None:
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": HEARTBEAT_S,
                "heartbeat_max_failure": MAX_FAILURES}  # fmt: skip
    transport = MooncakeTransport.open()
    with external_registry() as registry:
        await kill_9_then_a_late_put(registry, settings, transport)


async def kill_9_then_a_late_put(registry: str, settings: dict[str, Any],
                                 transport: MooncakeTransport) -> None:  # fmt: skip
    """The steps of the test above, against the registry process it started."""
    async with (
        anyio.create_task_group() as tasks,
        transport,
        httpx.AsyncClient(base_url=f"http://{registry}", timeout=5) as http,
    ):
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            node = engine.node
            options = {"bootstrap": registry, "serve_bootstrap": False, "settings": settings,
                       "num_pages": 512}  # fmt: skip
            async with prefill_process(tasks, options) as first:
                assert first.ready["health"] != registry, "the prefill serves its own health"
                for room in range(3):
                    await first.start_room(room, 0, 64)
                    assert await engine.run_room(registry, room, 0, 64) == "Success"
                probed = {t.health for r in node.ranks for t in r.probe_targets()}
                assert probed == {first.ready["health"]}, "the decode probes the process itself"
                # Behind an external registry nothing but the prefill's own health endpoint
                # fails these rooms before waiting_timeout (300 s): the registry stays up.
                with anyio.fail_after(HEARTBEAT_S * MAX_FAILURES + 20):
                    stalled, killed_at = await stall_then_kill(engine, first, registry,
                                                               range(100, 105))  # fmt: skip
                noticed_within = time.monotonic() - killed_at
                with anyio.fail_after(5):
                    await first.process.wait()
                assert set(stalled.values()) == {"Failed"}
                assert (await http.get("/health")).status_code == 200
                lost = sum(r.snapshot().counters["prefill_instances_lost"] for r in node.ranks)
                assert lost == len(node.ranks)
            print(f"kill -9 noticed through the prefill's own health endpoint in "
                  f"{noticed_within:.2f}s (interval {HEARTBEAT_S}s x {MAX_FAILURES})")
            assert noticed_within < HEARTBEAT_S * MAX_FAILURES + 3

            async with prefill_process(tasks, options) as second:
                topology = (await http.get(TOPOLOGY)).json()
                # The dead process's registration, retried late: refused, nothing changes.
                late = await http.put("/route", json=late_registration(first.ready, topology))
                assert late.status_code == 409, late.text
                assert late.text.startswith("Superseded registration")
                rank = (await http.get(RANK_0)).json()
                assert rank["incarnation"] == second.ready["incarnation"]
                for room in range(200, 205):
                    await second.start_room(room, 0, 48)
                    with anyio.fail_after(15):
                        assert await engine.run_room(registry, room, 0, 48) == "Success"
                superseded = {i for r in node.ranks for i in r.snapshot().superseded}
            assert superseded == {first.ready["incarnation"]}, "never to be readmitted"
            assert engine.corrupt == []
        tasks.cancel_scope.cancel()


async def test_a_paused_prefill_does_not_slow_the_heartbeat_of_another(
    tmp_path: anyio.Path,
) -> None:
    """Each probe of a paused prefill takes the probe's whole read timeout (3 s): its kernel
    accepts the connection and nothing answers. Another prefill killed meanwhile must still be
    noticed within its own interval x max failures, not once per slow probe of the paused one."""
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": HEARTBEAT_S,
                "heartbeat_max_failure": MAX_FAILURES}  # fmt: skip
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512}
            async with (
                prefill_process(tasks, options) as paused,
                prefill_process(tasks, dict(options)) as killed,
            ):
                for first_room, prefill in ((0, paused), (10, killed)):
                    for room in range(first_room, first_room + 2):
                        await prefill.start_room(room, 0, 64)
                        assert await engine.run_room(prefill.ready["bootstrap"], room, 0,
                                                     64) == "Success"  # fmt: skip
                paused.process.send_signal(signal.SIGSTOP)
                await anyio.sleep(2 * HEARTBEAT_S)  # a probe of it is hanging now
                with anyio.fail_after(30):
                    stalled, killed_at = await stall_then_kill(
                        engine, killed, killed.ready["bootstrap"], range(100, 105)
                    )
                noticed_within = time.monotonic() - killed_at
                paused.process.send_signal(signal.SIGCONT)
                assert set(stalled.values()) == {"Failed"}
            print(f"kill -9 noticed in {noticed_within:.2f}s beside a paused prefill (interval "
                  f"{HEARTBEAT_S}s x {MAX_FAILURES})")
            assert noticed_within < HEARTBEAT_S * MAX_FAILURES + 2
        tasks.cancel_scope.cancel()


async def answer_200_without_incarnation(reader: asyncio.StreamReader,
                                         writer: asyncio.StreamWriter) -> None:  # fmt: skip
    """Any HTTP server that is not a pdflow prefill: 200 to every request, no incarnation."""
    with suppress(asyncio.IncompleteReadError, ConnectionError):
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nOK")
            await writer.drain()
    writer.close()


async def test_a_server_that_took_a_dead_prefills_health_port_does_not_keep_it_alive(
    tmp_path: anyio.Path,
) -> None:
    """A prefill killed with -9 whose health port another HTTP server binds at once: that
    server's 200 carries no incarnation, so it speaks for no prefill and must count as a failed
    probe (it kept the dead prefill alive, its rooms failing only at waiting_timeout)."""
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": HEARTBEAT_S,
                "heartbeat_max_failure": MAX_FAILURES}  # fmt: skip
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512}
            async with prefill_process(tasks, options) as prefill:
                bootstrap = prefill.ready["bootstrap"]
                await prefill.start_room(0, 0, 64)
                assert await engine.run_room(bootstrap, 0, 0, 64) == "Success"
                host, _, port = prefill.ready["health"].rpartition(":")
                rooms = range(100, 103)
                async with anyio.create_task_group() as group:
                    outcomes = start_rooms(group, engine, prefill, bootstrap, rooms, 128, True)
                    with anyio.fail_after(10):
                        while sum(isinstance(e, RoomStatus) and e.room in rooms
                                  and e.poll is KVPoll.Transferring
                                  for e in engine.events) < len(rooms) * 2:  # fmt: skip
                            await anyio.sleep(0.01)
                    prefill.kill()
                    await prefill.process.wait()
                    impostor = await asyncio.start_server(answer_200_without_incarnation,
                                                          host, int(port))  # fmt: skip
                    killed_at = time.monotonic()
                    async with impostor:
                        with anyio.fail_after(HEARTBEAT_S * MAX_FAILURES + 10):
                            while len(outcomes) < len(rooms):
                                await anyio.sleep(0.05)
                noticed_within = time.monotonic() - killed_at
            assert set(outcomes.values()) == {"Failed"}
            print(f"kill -9 noticed in {noticed_within:.2f}s with an impostor on its health port")
            lost = sum(r.snapshot().counters["prefill_instances_lost"] for r in engine.node.ranks)
            assert lost == len(engine.node.ranks)
        tasks.cancel_scope.cancel()


WEDGE_LIMIT_S = 1.0


@pytest.mark.parametrize("hosted_registry", [True, False], ids=["hosted", "external"])
async def test_a_wedged_rank_fails_its_probe_and_is_readmitted_once_it_turns_again(
    tmp_path: anyio.Path, hosted_registry: bool
) -> None:
    """A prefill whose rank 0 is stuck inside a step (its endpoint lock held) answers its health
    probe 503 naming the rank once the step has run past control_stall_limit, so the decode
    fails its rooms as for a paused process; they waited for waiting_timeout (300 s) while the
    process answered 200. Once the step ends it answers 200 again and is readmitted."""
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": HEARTBEAT_S,
                "heartbeat_max_failure": MAX_FAILURES,
                "control_stall_limit": WEDGE_LIMIT_S}  # fmt: skip
    with ExitStack() as stack:
        registry = "127.0.0.1:0" if hosted_registry else stack.enter_context(external_registry())
        async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
            async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
                options = {"bootstrap": registry, "serve_bootstrap": hosted_registry,
                           "settings": settings, "num_pages": 512}  # fmt: skip
                async with (
                    prefill_process(tasks, options) as prefill,
                    httpx.AsyncClient(base_url=f"http://{prefill.ready['health']}") as http,
                ):
                    bootstrap = prefill.ready["bootstrap"]
                    await prefill.start_room(0, 0, 64)
                    assert await engine.run_room(bootstrap, 0, 0, 64) == "Success"
                    await prefill.send(op="wedge", rank=0)
                    async with anyio.create_task_group() as group:
                        outcomes = start_rooms(group, engine, prefill, bootstrap, range(100, 103))
                        with anyio.fail_after(WEDGE_LIMIT_S + HEARTBEAT_S * MAX_FAILURES + 10):
                            while len(outcomes) < 3:
                                await anyio.sleep(0.05)
                    assert set(outcomes.values()) == {"Failed"}
                    wedged = await http.get("/health")
                    assert wedged.status_code == 503, wedged.text
                    assert wedged.text.startswith("rank 0's control step has run"), wedged.text
                    assert wedged.headers["x-pdflow-incarnation"] == prefill.ready["incarnation"]
                    await prefill.send(op="unwedge")
                    await wait_readmitted(engine.node, timeout_s=20)
                    assert (await http.get("/health")).status_code == 200
                    await prefill.start_room(200, 0, 64)
                    with anyio.fail_after(15):
                        assert await engine.run_room(bootstrap, 200, 0, 64) == "Success"
                assert engine.corrupt == []
            tasks.cancel_scope.cancel()


async def test_a_long_step_within_the_stall_limit_keeps_the_prefill_healthy(
    tmp_path: anyio.Path,
) -> None:
    """A step that runs long (1.5 s) but under control_stall_limit (3 s) is busy, not wedged:
    every probe meanwhile answers 200 and its room succeeds."""
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": HEARTBEAT_S,
                "heartbeat_max_failure": MAX_FAILURES, "control_stall_limit": 3.0}  # fmt: skip
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512}
            async with (
                prefill_process(tasks, options) as prefill,
                httpx.AsyncClient(base_url=f"http://{prefill.ready['health']}") as http,
            ):
                bootstrap = prefill.ready["bootstrap"]
                await prefill.send(op="wedge", rank=0, seconds=1.5)
                answers: list[int] = []
                async with anyio.create_task_group() as group:
                    outcomes = start_rooms(group, engine, prefill, bootstrap, range(1))
                    with anyio.fail_after(10):
                        while prefill.counts["wedged"] == 0:
                            await anyio.sleep(0.01)
                    while prefill.counts["unwedged"] == 0:
                        answers.append((await http.get("/health")).status_code)
                        await anyio.sleep(0.1)
                assert outcomes == {0: "Success"}
                assert len(answers) >= 10 and set(answers) == {200}, answers
                counters = [r.snapshot().counters for r in engine.node.ranks]
                assert sum(c.get("heartbeat_failures", 0) for c in counters) == 0
        tasks.cancel_scope.cancel()


async def test_a_dead_prefill_nobody_replaces_is_given_up_and_its_client_closed(
    tmp_path: anyio.Path,
) -> None:
    """kill -9, no restart: once its rooms are cleared, lost_instance_forget after the verdict
    the decode stops probing it and closes its bootstrap client (both were kept for ever)."""
    forget_s = 2.0
    settings = {"trace_dir": str(tmp_path), "checksum": True, "heartbeat_interval": HEARTBEAT_S,
                "heartbeat_max_failure": MAX_FAILURES,
                "lost_instance_forget": forget_s}  # fmt: skip
    async with anyio.create_task_group() as tasks, MooncakeTransport.open() as transport:
        async with decode_engine(tasks, transport, settings, num_pages=512) as engine:
            node = engine.node
            options = {"bootstrap": "127.0.0.1:0", "settings": settings, "num_pages": 512}
            async with prefill_process(tasks, options) as prefill:
                bootstrap = prefill.ready["bootstrap"]
                await prefill.start_room(0, 0, 64)
                assert await engine.run_room(bootstrap, 0, 0, 64) == "Success"
                with anyio.fail_after(HEARTBEAT_S * MAX_FAILURES + 20):
                    stalled, killed_at = await stall_then_kill(engine, prefill, bootstrap,
                                                               range(100, 102))  # fmt: skip
                assert set(stalled.values()) == {"Failed"}
                assert bootstrap in node._clients
                with anyio.fail_after(forget_s + HEARTBEAT_S * MAX_FAILURES + 5):
                    while node._clients or any(r.probe_targets() for r in node.ranks):
                        await anyio.sleep(0.05)
                given_up_within = time.monotonic() - killed_at
            print(f"a dead prefill given up {given_up_within:.2f}s after kill -9")
            forgotten = [r.snapshot().counters["prefill_instances_forgotten"] for r in node.ranks]
            assert forgotten == [1] * len(node.ranks)
        tasks.cancel_scope.cancel()
