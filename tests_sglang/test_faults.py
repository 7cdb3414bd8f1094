"""(d) Faults through the SGLang backend, one decode process throughout (never restarted):

1. An abort mid-transfer: the prefill is frozen (SIGSTOP) so its drain ACK cannot come; SGLang's
   release-anyway deadline (shortened to 1 s with SGLang's own setting) passes and SGLang's own
   deferred-release code still holds the pages; they come back only after the prefill resumes,
   drains and pdflow reports ``PagesReleased``.
2. kill -9 of the prefill with rooms in flight: the rooms fail with pdflow's reason, and their
   pages stay held past SGLang's deadline (Mooncake cannot fence a dead writer's session on the
   receiving side, so pdflow keeps them quarantined rather than guess).
3. A new prefill process on the same bootstrap address: the same decode serves its rooms.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.ports import free_port

from tests_sglang.processes import DriverProcess

LOGS = Path(__file__).resolve().parents[1] / "out" / "sglang" / "logs"
RELEASE_TIMEOUT_S = 1.0  # SGLang's SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT
GEOMETRY = ["--pages-per-room", "4", "--chunk-pages", "2", "--pool-pages", "256",
            "--aux-slots", "64"]  # fmt: skip


class Cluster:
    def __init__(self) -> None:
        self.port = free_port()
        self.prefills: list[DriverProcess] = []
        self.decode = DriverProcess(
            "decode", "--backend", "pdflow", "--bootstrap-port", str(self.port), *GEOMETRY,
            "--http-port", str(free_port()), log_dir=LOGS,
            env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT":
                 str(RELEASE_TIMEOUT_S), "PDFLOW_HEARTBEAT_INTERVAL": "3"},
        )  # fmt: skip

    def prefill(self, *args: str) -> DriverProcess:
        process = DriverProcess(
            "prefill", "--backend", "pdflow", "--bootstrap-port", str(self.port), *GEOMETRY,
            "--serve-bootstrap", "--http-port", str(free_port()), *args, log_dir=LOGS,
        )  # fmt: skip
        self.prefills.append(process)
        process.wait_for("prefill_ready", timeout=240)
        return process

    def stop(self) -> None:
        for process in [self.decode, *self.prefills]:
            process.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    try:
        cluster.decode.wait_for("decode_ready", timeout=240)
        yield cluster
    finally:
        cluster.stop()


STALLED = [5000, 5001, 5002, 5003, 5004]


@pytest.fixture(scope="module")
def first_prefill(cluster: Cluster) -> DriverProcess:
    stalls = [arg for room in STALLED for arg in ("--stall-room", str(room))]
    return cluster.prefill("--rooms", str(len(STALLED)), "--room-base", "5000", "--linger",
                           *stalls)  # fmt: skip


def test_an_aborted_rooms_pages_stay_held_past_sglangs_deadline_until_pdflow_releases(
    cluster: Cluster, first_prefill: DriverProcess,
) -> None:
    decode = cluster.decode
    decode.command(cmd="batch", count=1, base=5000, bootstrap_port=cluster.port)
    first_prefill.wait_for("room_stalled", timeout=60, room=5000)
    time.sleep(0.5)  # the first chunk lands; the room stays in flight
    first_prefill.signal(signal.SIGSTOP)  # its drain ACK cannot come now
    try:
        decode.command(cmd="abort", room=5000)
        failed = decode.wait_for("receiver_failed", timeout=30, room=5000)
        assert "aborted by SGLang" in failed["reason"], failed
        time.sleep(3 * RELEASE_TIMEOUT_S)
        assert not decode.seen("pages_released", room=5000), "released before pdflow said so"
        assert 5000 in decode.report()["held"]
    finally:
        first_prefill.signal(signal.SIGCONT)
    released = decode.wait_for("pages_released", timeout=30, room=5000)
    assert released["held_s"] >= 3 * RELEASE_TIMEOUT_S
    assert 5000 not in decode.report()["held"]


def test_kill_9_of_the_prefill_fails_its_rooms_and_keeps_their_pages_held(
    cluster: Cluster, first_prefill: DriverProcess,
) -> None:
    decode = cluster.decode
    rooms = STALLED[1:]
    decode.command(cmd="batch", count=len(rooms), base=rooms[0], bootstrap_port=cluster.port)
    for room in rooms:
        first_prefill.wait_for("room_stalled", timeout=60, room=room)
    time.sleep(0.5)
    first_prefill.signal(signal.SIGKILL)
    for room in rooms:
        failed = decode.wait_for("receiver_failed", timeout=60, room=room)
        assert "KVTransferError" in failed["reason"] and "prefill" in failed["reason"], failed
    time.sleep(3 * RELEASE_TIMEOUT_S)
    held = decode.report()["held"]
    assert set(rooms) <= set(held), held
    assert not any(decode.seen("pages_released", room=room) for room in rooms)


def test_a_restarted_prefill_is_served_without_restarting_the_decode(
    cluster: Cluster, first_prefill: DriverProcess,
) -> None:
    first_prefill.signal(signal.SIGKILL)  # whatever the tests above left of it
    first_prefill.proc.wait(timeout=30)
    second = cluster.prefill("--rooms", "8", "--room-base", "6000")
    decode = cluster.decode
    decode.command(cmd="batch", count=8, base=6000, bootstrap_port=cluster.port)
    done = decode.wait_for("batch_done", timeout=120, base=6000)
    assert done["success"] == 8 and done["wrong_pages"] == done["wrong_aux"] == 0, done
    second.wait_for("prefill_finished", timeout=60)
    assert decode.proc.poll() is None
