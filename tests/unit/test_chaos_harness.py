"""The chaos harness's pieces without a cluster: the nemesis's timing and records, how attempts
are classed and retried, the reproduce line, start failures, the byte pattern."""

from __future__ import annotations

import signal
import time
from typing import Any

import anyio
import numpy as np
import pytest

from pdflow.chaos import session, workload
from pdflow.chaos.checker import check
from pdflow.chaos.kv_pattern import fill, mismatch, rank_caches
from pdflow.chaos.nemesis import Applied, Fault, Nemesis
from pdflow.chaos.netns import LoopbackNetwork, Network, NetworkError
from pdflow.chaos.procs import Pending, StartFailed
from pdflow.chaos.report import reproduce_command
from pdflow.chaos.run import ChaosOptions, RunRecord, pdflow_environment, plan_schedule
from pdflow.chaos.workload import Attempt, PlannedRequest, Router


class Processes:
    def __init__(self, running: bool = True) -> None:
        self.running = running
        self.calls: list[tuple[str, str]] = []

    def send_signal(self, name: str, signum: signal.Signals) -> bool:
        self.calls.append((signum.name, name))
        return self.running

    async def kill(self, name: str) -> bool:
        self.calls.append(("kill", name))
        return self.running

    async def restart(self, name: str) -> None:
        self.calls.append(("restart", name))

    async def pause_at_write(self, prefill: str, decode: str, within_s: float) -> bool:
        raise AssertionError("not planned")


def run_nemesis(faults: list[Fault], network: Network | None, procs: Processes,
                late_s: float = 0.0) -> list[Applied]:  # fmt: skip
    nemesis = Nemesis(faults, network, procs.kill, procs.restart,  # type: ignore[arg-type]
                      procs.send_signal, procs.pause_at_write,
                      time.monotonic() - late_s)  # fmt: skip
    anyio.run(nemesis.run)
    return nemesis.applied


def test_a_fault_that_starts_late_still_lasts_its_planned_length() -> None:
    """Planned at t=0 for 0.3 s, begun at t=0.2: it lasts 0.3 s from then, not 0.1 s."""
    procs = Processes()
    (applied,) = run_nemesis([Fault(at=0.0, duration=0.3, kind="pause", target="prefill-0")],
                             None, procs, late_s=0.2)  # fmt: skip
    assert applied.applied and applied.started is not None and applied.healed is not None
    assert applied.healed - applied.started >= 0.3
    assert applied.late_s is not None and applied.late_s >= 0.2
    assert procs.calls == [("SIGSTOP", "prefill-0"), ("SIGCONT", "prefill-0")]


def test_a_process_fault_on_a_process_not_running_is_not_applied() -> None:
    procs = Processes(running=False)
    pause, kill = run_nemesis([Fault(0.0, 0.01, "pause", "prefill-0"),
                               Fault(0.02, 0.01, "kill", "prefill-1")], None, procs)  # fmt: skip
    assert "not running" in pause.error and "not running" in kill.error
    assert not pause.applied and not kill.applied
    run = history(faults=[pause, kill])
    assert [v.kind for v in check(run)] == []  # the death itself is process_died's to report


class BrokenLinks(Network):
    kind = "netns"

    def link_down(self, host: str) -> None:
        pass

    def link_up(self, host: str) -> None:
        raise NetworkError("`ip link set up` failed: no such device")


def test_a_fault_the_nemesis_could_not_undo_is_a_violation() -> None:
    (applied,) = run_nemesis([Fault(0.0, 0.01, "partition", "decode-0")], BrokenLinks([]),
                             Processes())  # fmt: skip
    assert applied.applied and "no such device" in applied.heal_error
    (found,) = check(history(faults=[applied]))
    assert found.kind == "fault_heal_failed" and found.process == "decode-0"


def test_one_seed_plans_one_schedule_on_namespaces_and_on_loopback_which_skips_what_it_cannot(
) -> None:
    netns = plan_schedule(ChaosOptions(seed=3, duration_s=60.0))
    loopback = plan_schedule(ChaosOptions(seed=3, duration_s=60.0, namespaces=False))
    assert netns == loopback and {"partition", "slow"} & {f.kind for f in netns}
    network_faults = [f for f in netns if f.kind in ("partition", "oneway", "slow")][:2]
    procs = Processes()
    for applied in run_nemesis([Fault(0.0, 0.01, f.kind, f.target, f.peer)
                                for f in network_faults],
                               LoopbackNetwork(["decode-0"], "test"), procs):  # fmt: skip
        assert applied.skipped and "namespaces" in applied.skipped
        assert not applied.applied and applied.error == "" and applied.heal_error == ""
    assert procs.calls == []


def history(faults: list[Applied] | None = None, network: str = "netns",
            **fields: Any) -> RunRecord:  # fmt: skip
    return RunRecord(
        options=ChaosOptions(), network=network, addresses={}, unavailable={}, fault_means={},
        plan=[], faults=faults or [], attempts=[], shed=[], events=[], lives={},
        final_state={}, replays=[], workload_end=10.0, wall_s=20.0, **fields,
    )  # fmt: skip


def test_the_reproduce_line_says_loopback_when_the_run_fell_back_and_carries_pdflow_env() -> None:
    environment = pdflow_environment({"PDFLOW_SMALL_ROOM_STAGING_BYTES": "16384", "HOME": "/x",
                                      "PDFLOW_CHAOS_MUTANT": "noop_fence",
                                      "PDFLOW_BOOTSTRAP_TOKEN": "s3cret"})  # fmt: skip
    assert environment == {"PDFLOW_BOOTSTRAP_TOKEN": "<redacted>",
                           "PDFLOW_CHAOS_MUTANT": "noop_fence",
                           "PDFLOW_SMALL_ROOM_STAGING_BYTES": "16384"}  # fmt: skip
    line = reproduce_command(history(network="loopback", environment=environment))
    assert line.startswith("PDFLOW_BOOTSTRAP_TOKEN='<redacted>' PDFLOW_CHAOS_MUTANT=noop_fence "
                           "PDFLOW_SMALL_ROOM_STAGING_BYTES=16384 pdflow chaos --seed 1 ")
    assert line.endswith(" --loopback")  # namespaces were asked for; the run fell back
    assert not reproduce_command(history()).endswith("--loopback")


def test_a_start_failure_deep_in_task_groups_prints_its_log_tail(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    failed = StartFailed("decode-1 (life 1) did not become ready (EndOfStream); the end of "
                         "logs/decode-1-life1.log:\nImportError: no mooncake")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [failed])])
    assert session.start_failures(nested) == [failed]

    async def fails(options: ChaosOptions, say: Any) -> RunRecord:
        raise nested

    monkeypatch.setattr(session, "run_chaos", fails)
    monkeypatch.setattr(session, "_quiet_logs", lambda: None)  # keep structlog's global set-up
    assert session.run_and_report(ChaosOptions(namespaces=False)) == 2
    shown = capsys.readouterr().out
    assert "a process failed to start" in shown and "ImportError: no mooncake" in shown
    assert "sub-exception" not in shown


def attempt(decode: list[str], prefill: list[str]) -> Attempt:
    return Attempt(request=0, room=1, generation=0, prefill="prefill-0", prefill_life=1,
                   decode="decode-0", decode_life=1, bootstrap="b", tokens=16, abort_side=None,
                   started=0.0, decode_results=decode, prefill_results=prefill)  # fmt: skip


def test_a_room_the_decode_received_whole_is_served_whatever_became_of_its_prefill() -> None:
    assert attempt(["Success"] * 2, ["Success"] * 2).outcome == "success"
    assert attempt(["Success"] * 2, ["Killed"]).outcome == "served_prefill_killed"
    assert attempt(["Success"] * 2, ["Failed", "Failed"]).outcome == "served_prefill_failed"
    assert attempt(["Failed"] * 2, ["Killed"]).outcome == "prefill_killed"
    assert all(attempt(["Success"], p).served for p in (["Killed"], ["Failed"], ["Success"]))
    assert not attempt(["Success", "Failed"], ["Success"]).served


class Answering:
    """An agent that answers every room at once with the same results."""

    def __init__(self, name: str, results: list[str]) -> None:
        self.name, self.life, self.results = name, 1, results

    async def run_room(self, command: dict[str, Any]) -> Pending:
        answer = Pending()
        answer.set({"event": "room", "results": self.results, "reasons": [""]})
        return answer


def test_a_room_served_while_its_prefill_was_killed_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workload, "RETRY_PAUSE_S", 0.0)
    request = PlannedRequest(index=0, at=0.0, tokens=16, prefill=0, decode=0, chunk_pages=1,
                             room=42)  # fmt: skip
    prefills = [Answering("prefill-0", ["Killed"]), Answering("prefill-1", ["Success"])]
    router = Router([request], prefills, [Answering("decode-0", ["Success"])],  # type: ignore[arg-type]
                    {"prefill-0": "a", "prefill-1": "b"}, time.monotonic())  # fmt: skip
    router.in_flight = 1
    anyio.run(router._request, request)
    assert [(a.prefill, a.outcome) for a in router.attempts] == [
        ("prefill-0", "served_prefill_killed")]


def test_another_rooms_bytes_in_a_rooms_pages_are_seen() -> None:
    """Rooms 1 and 252 (and any pair) differ in nearly every byte; the old pattern, a function
    of (room * 131 + generation * 977) % 251, gave these two identical bytes."""
    (cache, kv), = rank_caches(1, 4)
    for room, other in [(1, 252), (7, 7 + 251 * 3), (1000, 1001)]:
        fill(cache, kv, room=other, generation=0, pages=[0, 1])
        assert "bytes differ" in mismatch(cache, kv, room, 0, [0, 1]), (room, other)
    fill(cache, kv, room=9, generation=2, pages=[2])
    other = np.array(cache.memory, copy=True)
    fill(cache, kv, room=9, generation=3, pages=[2])
    assert (np.array(cache.memory) != other).mean() > 0.9 * (1 / 4)  # one page of four changed
