"""`pdflow replay TRACE...`: re-run the recorded inputs through fresh endpoints, compare exactly."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdflow.trace.merge import Trace
    from pdflow.trace.replay import Divergence

_SHOWN_CHARS = 2000


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = sub.add_parser("replay", help="replay traces and check every step matches")
    replay.add_argument("traces", nargs="+", type=Path, help="trace files of one run (any order)")
    replay.add_argument(
        "--force", action="store_true", help="replay even if recorded against another spec"
    )
    replay.set_defaults(run=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    import sys

    from pdflow.cli.trace_cmd import load_or_explain, nothing_recorded
    from pdflow.trace.replay import CLOCK_WENT_BACK, ReplayRefused, replay

    trace = load_or_explain(args.traces)
    if trace is None:
        return 2
    if nothing_recorded(trace, "replay"):
        return 0
    try:
        result = replay(trace, force=args.force)
    except ReplayRefused as exc:
        print(f"replay refused: {exc}", file=sys.stderr)
        return 2
    if result.skipped_spec_check:
        print("warning: replaying against a different spec (--force)", file=sys.stderr)
    per_step = result.elapsed_s / max(result.records, 1) * 1e6
    if result.divergence is None:
        print(
            f"replay OK: {result.records} records, {len(result.endpoints)} endpoints "
            f"({', '.join(f'{k}: {v}' for k, v in result.per_endpoint.items())}), "
            f"identical; {result.elapsed_s:.3f}s ({per_step:.1f} us/step)"
        )
        return 0
    d = result.divergence
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
    print(_what_to_do(trace, d, args.traces, result.skipped_spec_check))
    return 1


def _what_to_do(trace: Trace, d: Divergence, paths: list[Path], forced: bool) -> str:
    """Why a step can diverge, most likely first for this trace, and where to look next."""
    import pdflow
    from pdflow.trace.replay import CLOCK_WENT_BACK

    recorded_by = trace.headers[d.endpoint].pdflow_version
    if any(diff.field == CLOCK_WENT_BACK for diff in d.diffs):
        cause = (f"records of {d.endpoint} were reordered or spliced, or the time of seq "
                 f"{d.seq} or {d.seq - 1} was edited; replay the files as the node wrote "
                 "them")  # fmt: skip
    elif forced:
        cause = ("it was recorded against another spec and replayed with --force: where the "
                 "spec changed, steps are expected to diverge; replay it with the pdflow that "
                 "recorded it")  # fmt: skip
    elif recorded_by != pdflow.__version__:
        cause = (f"the trace was recorded by pdflow {recorded_by} and this is "
                 f"{pdflow.__version__}: replay it with the pdflow that recorded it")  # fmt: skip
    else:
        cause = ("this pdflow recorded it under the same spec, so the record (or an earlier "
                 f"input of {d.endpoint}) was edited, or a modified core recorded it (a "
                 "`pdflow check --mutants` trace diverges where its mutant acted: that is the "
                 "bug it shows); if neither, the core is not deterministic: report it with "
                 "this trace")  # fmt: skip
    files = " ".join(shlex.quote(str(p)) for p in paths)
    rooms = "".join(f" --room {room}" for room in d.rooms)
    look = f"pdflow trace show {files}{rooms}" if rooms else f"pdflow trace show {files}"
    return f"what to do: {cause}.\n  the timeline of what was recorded: {look}"


def _show(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + " ..."
