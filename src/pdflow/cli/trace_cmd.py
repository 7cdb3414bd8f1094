"""`pdflow trace show|check|demo`: traces as per-room timelines; checks against the spec."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from pdflow.trace.merge import Trace


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trace = sub.add_parser("trace", help="show traces as room timelines, or check them")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)

    show = trace_sub.add_parser("show", help="per-room timelines in the terminal, or as HTML")
    show.add_argument("traces", nargs="+", type=Path, help="trace files of one run (any order)")
    show.add_argument(
        "--room", type=int, action="append", default=[], help="detail this room (repeatable)"
    )
    show.add_argument("--html", type=Path, default=None, help="write a self-contained page")
    show.add_argument("--limit", type=_at_least_one, default=40,
                      help="rooms listed in the summary")
    show.set_defaults(run=run_show)

    check = trace_sub.add_parser("check", help="verify every recorded transition is in the spec")
    check.add_argument("traces", nargs="+", type=Path)
    check.add_argument("--spec", type=Path, default=None, help="spec file (default: bundled)")
    check.set_defaults(run=run_check)

    demo = trace_sub.add_parser(
        "demo", help="record a deterministic run of real endpoints (for trying the tools)"
    )
    demo.add_argument("out", type=Path)
    demo.add_argument("--rooms", type=int, default=50)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=run_demo)


def load_or_explain(paths: list[Path]) -> Trace | None:
    from pdflow.trace.format import TraceFormatError
    from pdflow.trace.merge import TraceMergeError, load_traces

    folders = [str(p) for p in paths if p.is_dir()]
    if folders:
        hint = " ".join(f"{folder}/*.jsonl" for folder in folders)
        print(f"{', '.join(folders)}: a folder, not a trace file; give its files: {hint}",
              file=sys.stderr)  # fmt: skip
        return None
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"no such trace file: {', '.join(missing)}", file=sys.stderr)
        return None
    try:
        trace = load_traces(paths)
    except (TraceFormatError, TraceMergeError) as exc:
        print(f"cannot read the trace: {exc}", file=sys.stderr)
        return None
    for torn in trace.torn:
        print(f"warning: {torn}", file=sys.stderr)
    _warn_missing_senders(trace)
    return trace


def nothing_recorded(trace: Trace, verb: str) -> bool:
    """Say so, rather than "OK: 0 records", when the files hold headers alone: nothing failed
    (a process killed before its first step leaves such a file), but nothing was checked."""
    if trace.records:
        return False
    print(f"nothing to {verb}: endpoint headers but no step record ({', '.join(trace.headers)});"
          " the node stopped before its first step, or was killed with its first records still "
          "buffered")  # fmt: skip
    return True


def _warn_missing_senders(trace: Trace) -> None:
    """Messages received from records that are not here: the files of one run are incomplete,
    or (when no message ties a file to the others) they are not all from one run."""
    for sender, count in sorted(trace.absent_senders.items()):
        print(f"warning: {count} message(s) received from {sender}, whose trace is not among "
              "these files; give its file too (or check that all files are from one run)",
              file=sys.stderr)  # fmt: skip
    for sender, (last, named) in sorted(trace.cut_short.items()):
        held = f"its records end at seq {last}" if last >= 0 else "it has no step record"
        print(f"warning: endpoint {sender}: {held}, but a message it sent at seq {named} was "
              "received; its trace was cut, or its process was killed before its last records "
              "were written", file=sys.stderr)  # fmt: skip


def run_show(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdflow.trace.timeline import build_timelines
    from pdflow.trace.timeline_html import write_html
    from pdflow.trace.timeline_text import AUTO_DETAIL_ROOMS, render_room, render_summary

    trace = load_or_explain(args.traces)
    if trace is None:
        return 2
    if nothing_recorded(trace, "show"):
        return 0
    _warn_partial(trace, bundled_spec=False)
    timelines = build_timelines(trace)
    endpoints = list(trace.headers)
    unknown = [r for r in args.room if r not in timelines]
    if unknown:
        print(f"no room {unknown} in this trace ({len(timelines)} rooms)", file=sys.stderr)
        return 2
    if args.html is not None and args.html.is_dir():
        print(f"--html {args.html} is a folder; name the page to write, e.g. "
              f"{args.html / 'timeline.html'}", file=sys.stderr)  # fmt: skip
        return 2
    if args.html is not None:
        title = f"pdflow trace: {', '.join(p.name for p in args.traces)}"
        write_html(args.html, timelines, endpoints, title, args.room[0] if args.room else None)
        print(f"wrote {args.html} ({len(timelines)} rooms, {len(trace.records)} records)")
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped or captured: do not wrap at 80 columns
    selected = args.room or (list(timelines) if len(timelines) <= AUTO_DETAIL_ROOMS else [])
    if not args.room:
        render_summary(console, timelines, endpoints, args.limit)
    for room in selected:
        render_room(console, timelines[room])
    return 0


def run_check(args: argparse.Namespace) -> int:
    from pdflow.spec import load_spec
    from pdflow.trace.monitor import check_records

    trace = load_or_explain(args.traces)
    if trace is None:
        return 2
    if nothing_recorded(trace, "check"):
        return 0
    try:
        spec = load_spec(args.spec)
    except (OSError, ValueError) as exc:  # missing, a folder, or not a protocol spec
        print(f"cannot load the spec {args.spec}: {exc}; give spec/protocol.toml (next to "
              "its machines/ folder), or leave --spec out for the bundled one", file=sys.stderr)
        return 2
    _warn_partial(trace, args.spec is None)
    report = check_records(trace.records, spec)
    if not report.ok:
        print(f"trace check FAILED at record {report.records} of {len(trace.records)}:")
        for violation in report.violations:
            print(f"  {violation}")
        return 1
    rows = sum(len(m.table.transitions) for m in spec.machines.values())
    print(
        f"trace check OK: {report.records} records, {report.transitions} transitions, "
        f"all in spec {spec.spec_version} ({len(report.rows_seen)} of {rows} rows exercised)"
    )
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _warn_partial(trace: Trace, bundled_spec: bool) -> None:
    """What limits a check's verdict, said before it: records rotated away are not checked,
    and a trace recorded against another spec is checked against this one."""
    from pdflow.trace.replay import spec_mismatches

    for name, (missing, found) in trace.gaps.items():
        print(f"warning: endpoint {name}: records from seq {missing} to {found - 1} are missing "
              "(rotated away?); only the records present are checked", file=sys.stderr)  # fmt: skip
    for name, (seq, t, before) in trace.backwards.items():
        print(f"warning: endpoint {name}: the clock goes back at seq {seq} ({t} after "
              f"{before}); no pdflow clock does that, so the file was spliced or edited",
              file=sys.stderr)  # fmt: skip
    if bundled_spec:
        for mismatch in spec_mismatches(trace):
            print(f"warning: {mismatch}; checked against this pdflow's spec", file=sys.stderr)


def run_demo(args: argparse.Namespace) -> int:
    from pdflow.trace.recorder import TraceRecorder
    from pdflow.trace.synthetic import SyntheticWorld, choose_scripts

    with TraceRecorder(args.out, clock="virtual") as recorder:
        world = SyntheticWorld(recorder, choose_scripts(args.rooms, args.seed), seed=args.seed)
        stats = world.run()
    scripts = Counter(world.scripts)
    print(
        f"wrote {args.out}: {stats.steps} steps ({stats.errors} refused), {args.rooms} rooms "
        f"({', '.join(f'{name}: {n}' for name, n in sorted(scripts.items()))})"
    )
    return 0
