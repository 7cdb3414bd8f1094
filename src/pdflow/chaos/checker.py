"""The chaos checker: reads the run's history (attempts, process events, end states, replays)
after healing and settling, and lists every violation.

What must hold:

* every attempt is terminal on both sides (a killed prefill's side counts as ended);
* the sides agree: a decode never reports Success for a room its live prefill failed;
* a successful room's decode pages hold exactly the bytes its prefill sent (checked byte by
  byte against the room's pattern; the nodes also run with checksums on);
* no page is written after it was released (the decode engine's canaries);
* no page leaked: at the end every decode ledger is whole (nothing reserved or quarantined),
  the engine's free list is whole and no room is open on any node; pages may stay held only for
  writers whose process life ended, and only under the decode's rotation threshold
  (``ROTATE_QUARANTINE_PERCENT`` of a rank's pool) and outside its staging ring: past it the
  decode must have fenced them by engine rotation;
* recovery without restarting any decode: every prefill x decode pair served a fresh room after
  the heal, and each decode ran one life only;
* no process died but those the nemesis killed (any other life that ended during the run is
  ``process_died``, even though the heal starts it again);
* every fault the nemesis put in place was undone (``fault_heal_failed`` otherwise);
* every process life's traces replay with ``pdflow replay``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from pdflow.chaos.run import ROTATE_QUARANTINE_PERCENT, RunRecord
from pdflow.chaos.workload import Attempt


class Violation(msgspec.Struct, kw_only=True):
    kind: str
    detail: str
    room: int | None = None
    generation: int | None = None
    process: str | None = None
    t: float | None = None
    timeline: str = ""


def settled(state: dict[str, Any]) -> bool:
    """A node's end state with nothing left in flight (a dead or silent node never settles)."""
    if state.get("dead") or state.get("timeout"):
        return False
    if "rooms_open" in state:  # prefill
        return not any(state["rooms_open"])
    return all(
        not r["rooms_open"] and r["free"] == r["pool"] and r["engine_free"] == r["pool"]
        for r in state.get("ranks", [])
    )


def check(run: RunRecord) -> list[Violation]:
    found: list[Violation] = []
    for attempt in run.attempts:
        found.extend(_attempt_violations(attempt))
    found.extend(_canary_violations([e for e in run.events if e.get("event") == "canary"]))
    for event in run.events:
        found.extend(_event_violations(event))
    ended = ended_incarnations(run)
    for name, state in sorted(run.final_state.items()):
        found.extend(_state_violations(name, state, ended))
    found.extend(_recovery_violations(run))
    found.extend(_death_violations(run))
    found.extend(_fault_violations(run))
    for replay in run.replays:
        if replay.returncode != 0:
            found.append(Violation(
                kind="replay_failed", process=replay.process,
                detail=f"life {replay.life}: `pdflow replay` exited {replay.returncode}: "
                       f"{replay.output.strip()[-600:]}",
            ))  # fmt: skip
    return found


def _attempt_violations(a: Attempt) -> list[Violation]:
    where: dict[str, Any] = {"room": a.room, "generation": a.generation, "t": a.started}
    if not a.decode_results:
        return [Violation(kind="not_terminal", process=a.decode, **where,
                          detail=f"{a.decode} never reported the room as ended "
                                 f"{a.decode_reasons or ''}".rstrip())]  # fmt: skip
    found = []
    if not a.prefill_results:
        found.append(Violation(kind="not_terminal", process=a.prefill, **where,
                               detail=f"{a.prefill} never reported the room as ended "
                                      f"{a.prefill_reasons or ''}".rstrip()))  # fmt: skip
    if any(r in ("Killed", "NotRunning") for r in a.decode_results):
        found.append(Violation(kind="decode_died", process=a.decode, **where,
                               detail="; ".join(a.decode_reasons)))  # fmt: skip
    for side, results, reasons in (("decode", a.decode_results, a.decode_reasons),
                                   ("prefill", a.prefill_results, a.prefill_reasons)):  # fmt: skip
        if "Refused" in results:
            found.append(Violation(kind="call_refused", process=getattr(a, side), **where,
                                   detail="; ".join(r for r in reasons if r)))  # fmt: skip
        if "NotForgotten" in results:
            found.append(Violation(kind="room_not_forgotten", process=getattr(a, side),
                                   **where, detail="the room was still open 20 s after "
                                                   "clear (it never drained)"))  # fmt: skip
    prefill_gone = any(r in ("Killed", "NotRunning") for r in a.prefill_results)
    if a.decode_ok and a.prefill_results and not a.prefill_ok and not prefill_gone:
        found.append(Violation(
            kind="sides_disagree", process=a.decode, **where,
            detail=f"decode {a.decode_results} but prefill {a.prefill_results} "
                   f"({'; '.join(a.prefill_reasons)})",
        ))  # fmt: skip
    if a.decode_ok and a.mismatch:
        found.append(Violation(kind="bytes_differ", process=a.decode, **where,
                               detail="; ".join(a.mismatch)))  # fmt: skip
    return found


def _canary_violations(events: list[dict[str, Any]]) -> list[Violation]:
    """One violation per released room and rank, listing its pages found written."""
    grouped: dict[tuple[str, int, int, int], list[dict[str, Any]]] = {}
    for e in events:
        key = (e["process"], e["rank"], e["released_room"], e["released_generation"])
        grouped.setdefault(key, []).append(e)
    found = []
    for (process, rank, room, generation), hits in grouped.items():
        pages = sorted(e["page"] for e in hits)
        after = min(e["found_at"] - e["released_at"] for e in hits)
        found.append(Violation(
            kind="write_after_release", process=process, t=min(e["t"] for e in hits),
            room=room, generation=generation,
            detail=f"rank {rank}: {len(pages)} pages {pages[:12]} changed after room {room} "
                   f"generation {generation} released them (found {after:.2f}s after the "
                   f"release, when {hits[0]['when']})",
        ))  # fmt: skip
    return found


def _event_violations(event: dict[str, Any]) -> list[Violation]:
    kind = event.get("event")
    if kind == "violation":
        detail = str({k: v for k, v in event.items() if k != "event"})
        return [Violation(kind=event["kind"], process=event["process"], t=event["t"],
                          room=event.get("room"), generation=event.get("generation"),
                          detail=detail)]  # fmt: skip
    return []


def _death_violations(run: RunRecord) -> list[Violation]:
    """A life that ended during the run without the nemesis killing it (one whose record does
    not say who ended it counts as such: the harness always records it)."""
    found = []
    for name, lives in sorted(run.lives.items()):
        for life in lives:
            if not life.get("lost") or life.get("ended_by") == "nemesis":
                continue
            ended = life.get("ended")
            log = Path(run.options.out_dir) / "logs" / f"{name}-life{life.get('life')}.log"
            found.append(Violation(
                kind="process_died", process=name,
                t=None if ended is None or not run.wall0 else round(ended - run.wall0, 3),
                detail=f"{name} life {life.get('life')} (pid {life.get('pid')}, incarnation "
                       f"{life.get('incarnation')}) ended with rc {life.get('returncode')} "
                       f"during the run and the nemesis did not kill it; see the end of {log}",
            ))  # fmt: skip
    return found


def _fault_violations(run: RunRecord) -> list[Violation]:
    """A fault that was not undone leaves the rest of the run, the checks included, under it."""
    return [Violation(kind="fault_heal_failed", process=f.fault.target, t=f.healed,
                      detail=f"{f.fault.describe()}: {f.heal_error}")
            for f in run.faults if f.heal_error]  # fmt: skip


def ended_incarnations(run: RunRecord) -> set[str]:
    """Incarnations of process lives that were lost (killed, or crashed) during the run."""
    return {life["incarnation"] for lives in run.lives.values() for life in lives
            if life.get("incarnation") and life.get("lost")}  # fmt: skip


def _state_violations(name: str, state: dict[str, Any], ended: set[str]) -> list[Violation]:
    if state.get("dead") or state.get("timeout"):
        return [Violation(kind="no_end_state", process=name,
                          detail=f"{name} did not answer for its end state: {state}")]  # fmt: skip
    found = []
    if "rooms_open" in state and any(state["rooms_open"]):
        detail = f"rooms still open per rank: {state['rooms_open']}"
        found.append(Violation(kind="room_left_open", process=name, detail=detail))
    for rank in state.get("ranks", []):
        label = f"rank {rank['rank']}"
        if rank["rooms_open"]:
            found.append(Violation(kind="room_left_open", process=name,
                                   detail=f"{label}: rooms {rank['rooms_open']}"))  # fmt: skip
        dead_pages = dead_staging = 0
        for held in rank["quarantine"]:
            # Pages may wait on a writer whose process life ended (no receiver-side fence on
            # Mooncake TCP: it can neither write nor ACK), up to the rotation threshold.
            live = [w for w in held["waiting_on"] if w[1] not in ended]
            if not live:
                dead_pages += held["pages"]
                dead_staging += held.get("staging_bytes", 0)
            if live:
                found.append(Violation(
                    kind="pages_quarantined", process=name, room=held["room"],
                    generation=held["generation"],
                    detail=f"{label}: {held['pages']} pages still quarantined after the settle, "
                           f"waiting on writers whose process is alive: {live}",
                ))  # fmt: skip
        limit = ROTATE_QUARANTINE_PERCENT / 100 * rank["pool"]
        if dead_pages > limit or dead_staging:
            found.append(Violation(
                kind="dead_writer_pages_kept", process=name,
                detail=f"{label}: {dead_pages} pages ({dead_staging} staging-ring bytes) held "
                       f"for writers whose process life ended, past the rotation threshold "
                       f"({limit:g} pages, no ring bytes): the decode did not fence them by "
                       f"engine rotation",
            ))  # fmt: skip
        lost = rank["pool"] - rank["free"] - rank["quarantined"]
        if lost:
            detail = (f"{label}: {lost} pages neither free nor quarantined in the ledger "
                      f"({rank['reserved']} reserved)")  # fmt: skip
            found.append(Violation(kind="pages_leaked", process=name, detail=detail))
        if rank["engine_free"] != rank["free"]:
            found.append(Violation(kind="pages_leaked", process=name,
                                   detail=f"{label}: the engine holds {rank['engine_free']} free "
                                          f"pages, the ledger {rank['free']}"))  # fmt: skip
    return found


def _recovery_violations(run: RunRecord) -> list[Violation]:
    found = []
    probes: dict[tuple[str, str], list[Attempt]] = {}
    for attempt in run.attempts:
        if attempt.probe:
            probes.setdefault((attempt.prefill, attempt.decode), []).append(attempt)
    for (prefill, decode), tries in sorted(probes.items()):
        if not any(t.outcome == "success" for t in tries):
            last = tries[-1]
            found.append(Violation(
                kind="no_recovery", process=decode, room=last.room, generation=last.generation,
                t=last.started,
                detail=f"{prefill} -> {decode} served no fresh room after the heal "
                       f"({len(tries)} tries; last: decode {last.decode_reasons}, prefill "
                       f"{last.prefill_reasons})",
            ))  # fmt: skip
    for name, lives in run.lives.items():
        if name.startswith("decode") and len(lives) != 1:
            found.append(Violation(kind="decode_restarted", process=name,
                                   detail=f"{name} ran {len(lives)} lives"))  # fmt: skip
    return found


def attach_timelines(run: RunRecord, violations: list[Violation], limit: int = 5) -> None:
    """The room's timeline (``pdflow trace show --room``) for the first rooms in violation."""
    traces = [f for lives in run.lives.values() for life in lives
              for f in sorted(Path(life["trace_dir"]).glob("*.jsonl*"))]  # fmt: skip
    if not traces:
        return
    rooms = []
    for violation in violations:
        if violation.room is not None and violation.room >= 0 and violation.room not in rooms:
            rooms.append(violation.room)
    for room in rooms[:limit]:
        shown = subprocess.run(
            [sys.executable, "-m", "pdflow.cli", "trace", "show", *map(str, traces),
             "--room", str(room), "--limit", "1"],
            capture_output=True, text=True, timeout=300, env=_wide_terminal(),
        )  # fmt: skip
        text = (shown.stdout + shown.stderr).strip()
        for violation in violations:
            if violation.room == room:
                violation.timeline = text


def _wide_terminal() -> dict[str, str]:
    import os

    return {**os.environ, "COLUMNS": "160", "NO_COLOR": "1", "TERM": "dumb"}
