"""`pdflow replay TRACE...`: re-run the recorded inputs through fresh endpoints, compare exactly."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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

    from pdflow.cli.trace_cmd import load_or_explain
    from pdflow.trace.replay import ReplayRefused, replay

    trace = load_or_explain(args.traces)
    if trace is None:
        return 2
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
    for diff in d.diffs:
        print(f"  {diff.field}:")
        print(f"    expected: {_show(diff.expected)}")
        print(f"    got:      {_show(diff.got)}")
    return 1


def _show(value: object) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + " ..."
