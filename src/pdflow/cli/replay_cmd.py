"""`pdflow replay TRACE...`: re-run the recorded inputs through fresh endpoints, compare exactly."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pdflow.trace.follow import Follow, Stepper
    from pdflow.trace.merge import Trace
    from pdflow.trace.replay import Divergence, ReplayResult, StopPoint

_SHOWN_CHARS = 2000


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay traces and check every step matches; follow rooms or endpoints step by step",
        description="Re-run every recorded input through fresh endpoints and check each step "
        "against its record. With --room, --endpoint or --all-steps, print each followed step "
        "as it is replayed (input, transitions, outputs, room state before -> after), and the "
        "replayed state of what is followed where replay stops (--until, a divergence, or the "
        "end).",
    )
    replay.add_argument("traces", nargs="+", type=Path, help="trace files of one run (any order)")
    replay.add_argument(
        "--force", action="store_true", help="replay even if recorded against another spec"
    )
    replay.add_argument("--room", type=int, action="append", default=[], metavar="R",
                        help="follow room R: every endpoint's steps that concern it "
                             "(repeatable)")  # fmt: skip
    replay.add_argument("--endpoint", action="append", default=[], metavar="E",
                        help="follow endpoint E's steps (repeatable; with --room, only its "
                             "steps that concern the room)")  # fmt: skip
    replay.add_argument("--all-steps", action="store_true", help="follow every step")
    replay.add_argument("--until", metavar="ENDPOINT:SEQ", default=None,
                        help="stop after this record and show the state there (alone: that "
                             "endpoint's state)")  # fmt: skip
    replay.add_argument("--json", action="store_true",
                        help="print one JSON object: verdict, followed steps, divergence, "
                             "state where replay stopped")  # fmt: skip
    replay.set_defaults(run=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    import sys

    from pdflow.cli.trace_cmd import load_or_explain, nothing_recorded
    from pdflow.trace.follow import (
        Follow,
        FollowError,
        check_endpoints,
        check_rooms,
        parse_stop_point,
    )

    trace = load_or_explain(args.traces)
    if trace is None:
        return 2
    if nothing_recorded(trace, "replay"):
        return 0
    follow = Follow(frozenset(args.room), frozenset(args.endpoint), args.all_steps)
    try:
        check_endpoints(args.endpoint, trace)
        check_rooms(args.room, trace)
        stop = parse_stop_point(args.until, trace) if args.until is not None else None
    except FollowError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    if not (follow.shows_steps or stop or args.json):
        return _verify(trace, args)
    return _follow(trace, args, follow, stop)


def _verify(trace: Trace, args: argparse.Namespace) -> int:
    """Replay everything and say whether every step matched: the command's default."""
    result = _replay_or_explain(trace, args)
    if result is None:
        return 2
    per_step = result.elapsed_s / max(result.records, 1) * 1e6
    if result.divergence is None:
        print(
            f"replay OK: {result.records} records, {len(result.endpoints)} endpoints "
            f"({', '.join(f'{k}: {v}' for k, v in result.per_endpoint.items())}), "
            f"identical; {result.elapsed_s:.3f}s ({per_step:.1f} us/step)"
        )
        return 0
    _print_divergence(trace, result.divergence, args, result)
    return 1


def _follow(
    trace: Trace, args: argparse.Namespace, follow: Follow, stop: StopPoint | None
) -> int:
    """Replay with the followed steps printed as they run, then the state where it stopped."""
    from pdflow.trace.follow import Stepper, StepView, state_at_stop
    from pdflow.trace.follow_text import state_lines, step_lines
    from pdflow.trace.timeline import endpoint_names

    names = endpoint_names(trace)
    views: list[StepView] = []  # with --json: printed in the one JSON object at the end
    shown: list[int] = []  # in text: printed as they come

    def take(view: StepView) -> None:
        if args.json:
            views.append(view)
        else:
            shown.append(view.seq)
            print("\n".join(step_lines(view, names)))

    stepper = Stepper(follow, take)
    result = _replay_or_explain(trace, args, stepper, stop)
    if result is None:
        return 2
    state = state_at_stop(trace, result, follow, stop, stepper)
    d = result.divergence
    if args.json:
        print(json.dumps(msgspec.to_builtins({
            "verdict": "diverged" if d else "stopped" if result.stopped else "identical",
            "records": result.records, "per_endpoint": result.per_endpoint,
            "forced": result.skipped_spec_check, "steps": views, "divergence": d,
            "what_to_do": _what_to_do(trace, d, args, result) if d else None,
            "state": state,
        }), sort_keys=True))  # fmt: skip
        return 1 if d else 0
    if follow.shows_steps and not shown:
        print("no followed step was replayed before replay stopped")
    if d is not None:
        if shown:
            print(f"(the {len(shown)} steps above were replayed by this pdflow's core and each "
                  "matched its record; the first record that does not is below, and replay "
                  "cannot go past it)")
        _print_divergence(trace, d, args, result)
        where = f"where replay stopped, after the last matching step (before {d.endpoint} " \
                f"seq {d.seq})"  # fmt: skip
    elif result.stopped:
        assert result.last is not None  # a stop point is a record that was replayed
        last = result.last
        print(f"replay stopped after {last.endpoint} seq {last.seq} (t={last.t}) as asked: "
              f"{result.records} records replayed, every one identical to its record")
        where = f"after {last.endpoint} seq {last.seq}"
    else:
        print(f"replay OK: {result.records} records, all identical; the state is the end of "
              "the trace")
        where = "at the end of the trace"
    if state.rooms or state.endpoints:
        print("\n".join(state_lines(state, names, where)))
    return 1 if d else 0


def _replay_or_explain(
    trace: Trace,
    args: argparse.Namespace,
    stepper: Stepper | None = None,
    stop: StopPoint | None = None,
) -> ReplayResult | None:
    import sys

    from pdflow.trace.replay import ReplayRefused, replay

    try:
        result = replay(
            trace, force=args.force, until=stop,
            on_step=stepper.after_step if stepper else None,
            before_step=stepper.before_step if stepper else None,
        )  # fmt: skip
    except ReplayRefused as exc:
        print(f"replay refused: {exc}", file=sys.stderr)
        return None
    if result.skipped_spec_check:
        print("warning: replaying against a different spec (--force)", file=sys.stderr)
    return result


def _print_divergence(
    trace: Trace, d: Divergence, args: argparse.Namespace, result: ReplayResult
) -> None:
    from pdflow.trace.replay import CLOCK_WENT_BACK

    print(
        f"replay DIVERGED at endpoint {d.endpoint} seq {d.seq} (t={d.t}), "
        f"after {result.records} matching records"
    )
    print(f"  input: {_show(d.input)}")
    if any(diff.field != CLOCK_WENT_BACK for diff in d.diffs):
        print("  (expected: as recorded; got: this replay)")
    for diff in d.diffs:
        if diff.field == CLOCK_WENT_BACK:
            print(f"  t: recorded at {diff.got}, before seq {d.seq - 1} of the same endpoint "
                  f"(t={diff.expected}); no pdflow clock goes back")  # fmt: skip
            continue
        print(f"  {diff.field}:")
        print(f"    expected: {_show(diff.expected)}")
        print(f"    got:      {_show(diff.got)}")
    print(_what_to_do(trace, d, args, result))


def _what_to_do(
    trace: Trace, d: Divergence, args: argparse.Namespace, result: ReplayResult
) -> str:
    """Why a step can diverge, most likely first for this trace, and where to look next."""
    import pdflow
    from pdflow.trace.replay import CLOCK_WENT_BACK

    header = trace.headers[d.endpoint]
    if any(diff.field == CLOCK_WENT_BACK for diff in d.diffs):
        cause = (f"records of {d.endpoint} were reordered or spliced, or the time of seq "
                 f"{d.seq} or {d.seq - 1} was edited; replay the files as the node wrote "
                 "them")  # fmt: skip
    elif header.mutant is not None:
        cause = (f"recorded under mutant {header.mutant}: it diverges where the mutant acts "
                 f"(`pdflow check --mutants`, seed {header.seed}); this step is the bug the "
                 "mutant plants, and the steps before it are how the world got there")  # fmt: skip
    elif result.skipped_spec_check:
        cause = ("it was recorded against another spec and replayed with --force: where the "
                 "spec changed, steps are expected to diverge; replay it with the pdflow that "
                 "recorded it")  # fmt: skip
    elif header.pdflow_version != pdflow.__version__:
        cause = (f"the trace was recorded by pdflow {header.pdflow_version} and this is "
                 f"{pdflow.__version__}: replay it with the pdflow that recorded it")  # fmt: skip
    elif header.clock == "virtual" and header.seed is not None:
        cause = (f"this pdflow recorded it under the same spec, in a simulated world (seed "
                 f"{header.seed}); if `pdflow check --mutants` wrote it, this step is where the "
                 "mutant core acted unlike the real one: that is the bug it shows, and the "
                 "steps before it are how the world got there. Otherwise the record (or an "
                 f"earlier input of {d.endpoint}) was edited, or the core is not "
                 "deterministic: report it with this trace")  # fmt: skip
    else:
        cause = ("this pdflow recorded it under the same spec, so the record (or an earlier "
                 f"input of {d.endpoint}) was edited, or a modified core recorded it; if "
                 "neither, the core is not deterministic: report it with this trace")  # fmt: skip
    files = " ".join(shlex.quote(str(p)) for p in args.traces)
    rooms = "".join(f" --room {room}" for room in d.rooms)
    lines = [f"what to do: {cause}.",
             f"  the timeline of what was recorded: pdflow trace show {files}{rooms}"]
    if rooms and not set(d.rooms) <= set(args.room):
        lines.append(f"  its room(s) step by step up to here: pdflow replay {files}{rooms}")
    return "\n".join(lines)


def _show(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + " ..."
