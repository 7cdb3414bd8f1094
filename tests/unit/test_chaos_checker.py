"""The chaos checker on recorded histories: a clean one passes, each broken fact is named."""

from __future__ import annotations

from typing import Any

from pdflow.chaos.checker import check
from pdflow.chaos.run import ChaosOptions, ReplayResult, RunRecord
from pdflow.chaos.workload import Attempt

LIVES = {
    "prefill-0": [{"incarnation": "p0-a", "lost": True, "ended_by": "nemesis"},
                  {"incarnation": "p0-b", "lost": False}],
    "decode-0": [{"incarnation": "d0", "lost": False}],
}


def attempt(room: int, decode: list[str], prefill: list[str], **fields: Any) -> Attempt:
    return Attempt(request=room, room=room, generation=0, prefill="prefill-0", prefill_life=2,
                   decode="decode-0", decode_life=1, bootstrap="b", tokens=16, abort_side=None,
                   started=1.0, decode_results=decode, prefill_results=prefill,
                   **fields)  # fmt: skip


def probe(ok: bool) -> Attempt:
    result = ["Success"] if ok else ["Failed"]
    return attempt(999, result, result, probe=True)


def decode_state(**rank: Any) -> dict[str, Any]:
    whole = {"rank": 0, "pool": 8, "free": 8, "reserved": 0, "quarantined": 0,
             "rooms_open": [], "engine_free": 8, "engine_in_use": 0, "quarantine": []}  # fmt: skip
    return {"event": "state", "ranks": [{**whole, **rank}]}


def record(attempts: list[Attempt], events: list[dict[str, Any]] | None = None,
           state: dict[str, Any] | None = None, replay_rc: int = 0,
           lives: dict[str, Any] | None = None) -> RunRecord:  # fmt: skip
    return RunRecord(
        options=ChaosOptions(), network="netns", addresses={}, unavailable={}, fault_means={},
        plan=[], faults=[], attempts=[*attempts, probe(True)], shed=[], events=events or [],
        lives=lives or LIVES, final_state={"decode-0": state or decode_state(),
                                           "prefill-0": {"event": "state", "rooms_open": [[]]}},
        replays=[ReplayResult("decode-0", 1, ["t.jsonl"], replay_rc, "replay DIVERGED")],
        workload_end=10.0, wall_s=20.0,
    )  # fmt: skip


def kinds(run: RunRecord) -> list[str]:
    return sorted(v.kind for v in check(run))


def test_a_clean_history_passes_even_with_a_killed_prefill_and_its_held_pages() -> None:
    """Pages held for an ended life, under the rotation threshold (1% of 1000 pages)."""
    held = [{"room": 5, "generation": 0, "pages": 2, "waiting_on": [["a:1", "p0-a"]]}]
    run = record([attempt(1, ["Success"], ["Success"]), attempt(2, ["Failed"], ["Killed"]),
                  attempt(3, ["Failed"], ["Success"])],  # the decode may give up after Success
                 state=decode_state(pool=1000, free=998, quarantined=2, engine_free=998,
                                    quarantine=held))  # fmt: skip
    assert check(run) == []


def test_pages_of_an_ended_life_past_the_rotation_threshold_or_in_the_ring_are_named() -> None:
    """The decode should have fenced them by engine rotation."""
    held = [{"room": 5, "generation": 0, "pages": 11, "waiting_on": [["a:1", "p0-a"]]}]
    state = decode_state(pool=1000, free=989, quarantined=11, engine_free=989, quarantine=held)
    assert kinds(record([], state=state)) == ["dead_writer_pages_kept"]
    staged = [{**held[0], "pages": 1, "staging_bytes": 4096}]
    state = decode_state(pool=1000, free=999, quarantined=1, engine_free=999, quarantine=staged)
    assert kinds(record([], state=state)) == ["dead_writer_pages_kept"]


def test_each_broken_fact_of_an_attempt_is_named() -> None:
    run = record([
        attempt(1, [], ["Success"]),
        attempt(2, ["Success"], ["Failed"]),
        attempt(3, ["Success"], ["Success"], mismatch=["rank 0: 3 bytes differ"]),
        attempt(4, ["Refused"], ["Success"], decode_reasons=["already open"]),
        attempt(5, ["Failed"], ["NotForgotten"]),
    ])  # fmt: skip
    assert kinds(run) == ["bytes_differ", "call_refused", "not_terminal", "room_not_forgotten",
                          "sides_disagree"]  # fmt: skip


def test_writes_after_release_are_grouped_per_released_room_and_rank() -> None:
    canary = {"event": "canary", "process": "decode-0", "rank": 0, "released_room": 7,
              "released_generation": 1, "released_at": 1.0, "found_at": 1.5, "when": "scan",
              "t": 3.0}  # fmt: skip
    run = record([], events=[{**canary, "page": 3}, {**canary, "page": 4},
                             {**canary, "page": 9, "rank": 1}])  # fmt: skip
    found = check(run)
    assert [(v.kind, v.room, v.generation) for v in found] == [("write_after_release", 7, 1)] * 2
    assert "2 pages [3, 4]" in found[0].detail


def test_an_unwhole_end_state_is_named() -> None:
    live = [{"room": 5, "generation": 0, "pages": 2, "waiting_on": [["a:1", "p0-b"]]}]
    run = record([], state=decode_state(free=3, reserved=3, quarantined=2, engine_free=4,
                                        rooms_open=[11], quarantine=live))  # fmt: skip
    assert kinds(run) == ["pages_leaked", "pages_leaked", "pages_quarantined", "room_left_open"]


def test_no_recovery_a_restarted_decode_and_a_failed_replay_are_named() -> None:
    run = record([probe(False)], replay_rc=1,
                 lives={**LIVES, "decode-0": [{"incarnation": "d0"}, {"incarnation": "d1"}]})
    run.attempts[:] = [a for a in run.attempts if not (a.probe and a.decode_ok)]
    assert kinds(run) == ["decode_restarted", "no_recovery", "replay_failed"]
