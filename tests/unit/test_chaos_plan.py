"""The chaos harness's seeded plans and its byte checks, without processes."""

from __future__ import annotations

import itertools
import json
import signal
import time
from pathlib import Path

import anyio
import pytest

from pdflow.chaos.kv_pattern import (
    CANARY,
    broken_canaries,
    fill,
    mismatch,
    page_view,
    paint_canary,
    rank_caches,
)
from pdflow.chaos.nemesis import (
    KINDS,
    MID_WRITE_WAIT_S,
    PAUSE_MID_WRITE,
    Fault,
    Nemesis,
    plan_faults,
)
from pdflow.chaos.session import summarize
from pdflow.chaos.workload import plan_workload
from pdflow.cli.chaos_cmd import parse_abort_sides, parse_kinds

PREFILLS, DECODES = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")


def test_one_seed_gives_one_fault_schedule_and_another_seed_another() -> None:
    first = plan_faults(3, 120.0, KINDS, PREFILLS, DECODES, 1.0)
    assert first == plan_faults(3, 120.0, KINDS, PREFILLS, DECODES, 1.0)
    assert first != plan_faults(4, 120.0, KINDS, PREFILLS, DECODES, 1.0)


def test_faults_do_not_overlap_and_end_before_the_workload_does() -> None:
    for seed in range(20):
        faults = plan_faults(seed, 60.0, KINDS, PREFILLS, DECODES, 7.0, tail_s=4.0)
        assert faults, seed
        for before, after in itertools.pairwise(faults):
            assert before.end < after.at
        assert faults[-1].end <= 56.0
        # A pause must outlast the heartbeat window, or it tests nothing.
        assert all(f.duration > 7.0 for f in faults if f.kind == "pause")
        assert {f.kind for f in faults} <= set(KINDS)


def test_only_the_kinds_asked_for_are_planned() -> None:
    faults = plan_faults(1, 120.0, ("kill",), PREFILLS, DECODES, 1.0)
    assert faults and {f.kind for f in faults} == {"kill"}
    assert all(f.target in PREFILLS for f in faults)  # decodes are never killed
    assert plan_faults(1, 120.0, (), PREFILLS, DECODES, 1.0) == []


def test_a_mid_write_pause_stops_a_prefill_in_a_write_to_a_decode_past_the_heartbeat_window(
) -> None:
    faults = plan_faults(1, 120.0, (PAUSE_MID_WRITE,), PREFILLS, DECODES, 7.0)
    assert faults and {f.kind for f in faults} == {PAUSE_MID_WRITE}
    assert all(f.target in PREFILLS and f.peer in DECODES for f in faults)
    assert {f.peer for f in faults} == set(DECODES)
    assert all(f.duration > 7.0 for f in faults)
    # The default kinds leave it out, so a seed run before it existed keeps its schedule.
    assert PAUSE_MID_WRITE not in KINDS
    assert plan_faults(1, 120.0, KINDS, PREFILLS, DECODES, 7.0) != plan_faults(
        1, 120.0, (*KINDS, PAUSE_MID_WRITE), PREFILLS, DECODES, 7.0)


class FakeProcesses:
    """The harness's process callbacks, recording what the nemesis asked for."""

    def __init__(self, write_begins: bool) -> None:
        self.write_begins = write_begins
        self.calls: list[tuple[str, ...]] = []

    async def pause_at_write(self, prefill: str, decode: str, within_s: float) -> bool:
        self.calls.append(("arm", prefill, decode, str(within_s)))
        await anyio.sleep(0.05)  # the armed prefill takes this long to begin a write
        return self.write_begins

    def send_signal(self, name: str, signum: signal.Signals) -> None:
        self.calls.append((signum.name, name))

    async def unused(self, name: str) -> None:
        raise AssertionError(f"a pause must not kill or restart {name}")


@pytest.mark.parametrize("write_begins", [True, False])
def test_a_mid_write_pause_runs_from_the_stop_and_says_so_when_no_write_came(
    write_begins: bool,
) -> None:
    fault = Fault(at=0.0, duration=0.2, kind=PAUSE_MID_WRITE, target="prefill-1",
                  peer="decode-0")  # fmt: skip
    procs = FakeProcesses(write_begins)
    nemesis = Nemesis([fault], None, procs.unused, procs.unused,  # type: ignore[arg-type]
                      procs.send_signal, procs.pause_at_write, time.monotonic())  # fmt: skip
    anyio.run(nemesis.run)
    (applied,) = nemesis.applied
    assert applied.started is not None and applied.healed is not None
    arm = ("arm", "prefill-1", "decode-0", str(MID_WRITE_WAIT_S))
    assert procs.calls == [arm, ("SIGCONT", "prefill-1")]  # the stop is the prefill's own
    if write_begins:
        assert applied.error == "" and applied.started >= 0.05
        assert applied.healed - applied.started >= 0.2  # the whole pause, from the stop
    else:
        assert "began no write to decode-0" in applied.error and "not paused" in applied.error


def test_the_workload_is_seeded_bounded_and_reuses_rooms_and_aborts_from_both_sides() -> None:
    plan = plan_workload(5, 60.0, 2, 2, rate_per_s=3.0, max_requests=400)
    assert plan == plan_workload(5, 60.0, 2, 2, rate_per_s=3.0, max_requests=400)
    assert all(r.at < 60.0 for r in plan) and len(plan) <= 400
    assert {r.abort_side for r in plan} == {None, "decode", "prefill"}
    reused = [r for r in plan if r.reuse_of is not None]
    assert reused and all(r.reuse_of < r.index for r in reused)
    fresh = [r.room for r in plan]  # the id a reuse falls back to while its room is busy
    assert len(fresh) == len(set(fresh))
    assert len(plan_workload(5, 60.0, 2, 2, max_requests=10)) == 10
    # Leaving a side out changes only who aborts, never the rest of the plan.
    prefill_only = plan_workload(5, 60.0, 2, 2, rate_per_s=3.0, max_requests=400,
                                 abort_sides=("prefill",))  # fmt: skip
    assert {r.abort_side for r in prefill_only} == {None, "prefill"}
    assert [(r.at, r.room, r.tokens) for r in prefill_only] == [(r.at, r.room, r.tokens)
                                                                 for r in plan]  # fmt: skip


def test_a_write_into_a_free_page_breaks_its_canary_and_only_its_own() -> None:
    (cache, kv), = rank_caches(1, 8)
    paint_canary(cache, kv, range(8))
    assert broken_canaries(cache, kv, list(range(8))) == []
    fill(cache, kv, room=9, generation=0, pages=[5])
    assert broken_canaries(cache, kv, list(range(8))) == [5]
    paint_canary(cache, kv, [5])
    page_view(cache, kv)[1, 3, 0, 0, 0] = CANARY - 1  # a single byte is enough
    assert broken_canaries(cache, kv, list(range(8))) == [3]


def test_the_byte_check_tells_generations_of_one_room_apart() -> None:
    (cache, kv), (cache1, kv1) = rank_caches(2, 4)
    fill(cache, kv, room=7, generation=1, pages=[0, 2])
    assert mismatch(cache, kv, 7, 1, [0, 2]) == ""
    assert "bytes differ" in mismatch(cache, kv, 7, 2, [0, 2])
    assert "bytes differ" in mismatch(cache, kv, 7, 1, [2, 0])  # page order matters
    fill(cache1, kv1, room=7, generation=1, pages=[0, 2])
    assert mismatch(cache1, kv1, 7, 1, [0, 2]) == ""  # the other rank's heads


def test_unknown_nemesis_kinds_are_refused_with_the_choices() -> None:
    assert parse_kinds("kill,pause") == ("kill", "pause")
    assert parse_kinds("pause,pause_mid_write") == ("pause", PAUSE_MID_WRITE)
    assert parse_kinds("none") == ()
    choices = r"unknown nemesis kind.*choose from partition.*pause_mid_write"
    with pytest.raises(ValueError, match=choices):
        parse_kinds("kill,flood")
    assert parse_abort_sides("prefill") == ("prefill",) and parse_abort_sides("none") == ()
    with pytest.raises(ValueError, match="choose from decode, prefill"):
        parse_abort_sides("client")


def test_summarize_reads_result_files_and_fails_when_any_run_found_a_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    def result(seed: int, violations: list[dict[str, str]]) -> Path:
        path = tmp_path / f"{seed}.json"
        attempt = {"probe": False, "decode_results": ["Success"], "prefill_results": ["Success"]}
        run = {"options": {"seed": seed, "duration_s": 120.0, "nemesis": ["kill"]},
               "network": "netns", "attempts": [attempt, {**attempt, "probe": True}],
               "faults": [{"fault": {"kind": "kill"}, "started": 4.0}]}  # fmt: skip
        path.write_text(json.dumps({"run": run, "violations": violations}))
        return path

    clean, dirty = result(1, []), result(2, [{"kind": "write_after_release"}])
    assert summarize([str(clean)]) == 0
    assert summarize([str(clean), str(dirty)]) == 1
    shown = capsys.readouterr().out
    assert "write_after_release 1" in shown and "kill 1" in shown
    assert summarize([str(tmp_path / "missing.json")]) == 2
