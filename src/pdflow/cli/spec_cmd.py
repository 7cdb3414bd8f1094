"""`pdflow spec check|render`: keep the code and spec/protocol.toml in lock-step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdflow.spec import Spec

DEFAULT_DOC = Path("docs/protocol.md")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    spec = sub.add_parser("spec", help="check the code against spec/ or render the protocol doc")
    spec_sub = spec.add_subparsers(dest="spec_command", required=True)
    check = spec_sub.add_parser("check", help="compare code tables and spec, both directions")
    check.add_argument("--spec", type=Path, default=None, help="spec file (default: bundled)")
    check.set_defaults(run=run_check)
    render = spec_sub.add_parser("render", help="write docs/protocol.md with Mermaid diagrams")
    render.add_argument("--out", type=Path, default=DEFAULT_DOC)
    render.add_argument(
        "--check", action="store_true", help="exit 1 if the file on disk is stale; write nothing"
    )
    render.set_defaults(run=run_render)


def run_check(args: argparse.Namespace) -> int:
    from pdflow.spec import check_spec, spec_path
    from pdflow.spec.load import machine_files

    path = args.spec or spec_path()
    spec = _load_or_explain(path)
    if spec is None:
        return 2
    diffs = check_spec(spec)
    if diffs:
        files = machine_files(path)
        print(f"spec check FAILED: {len(diffs)} difference(s) between {path} and the code:")
        for diff in diffs:
            where = f" ({files[diff.machine]})" if diff.machine in files else ""
            print(f"  - {diff.machine}{where}: {diff.where}: in the spec: {diff.in_spec}; "
                  f"in the code: {diff.in_code}")  # fmt: skip
        print("the spec is the protocol's source of truth: change the code's table to match it, "
              "or, for a protocol change, edit the spec first (then `pdflow spec render`)")
        return 1
    transitions = sum(len(m.table.transitions) for m in spec.machines.values())
    states = sum(len(m.states) for m in spec.machines.values())
    print(
        f"spec check OK: spec {spec.spec_version} ({path})\n"
        f"  machines={len(spec.machines)} states={states} transitions={transitions} "
        f"timers={len(spec.timers)} invariants={len(spec.invariants)}"
    )
    for name, machine in spec.machines.items():
        print(
            f"  {name}: {len(machine.states)} states, {len(machine.inputs)} inputs, "
            f"{len(machine.table.transitions)} transitions"
        )
    return 0


def _load_or_explain(path: Path | None) -> Spec | None:
    from pdflow.spec import load_spec

    try:
        return load_spec(path)
    except (OSError, ValueError) as exc:  # missing, a folder, malformed TOML or schema
        print(f"cannot load the spec: {exc}; fix that file, or give spec/protocol.toml (next to "
              "its machines/ folder) with --spec", file=sys.stderr)  # fmt: skip
        return None


def run_render(args: argparse.Namespace) -> int:
    from pdflow.spec.render import render_markdown

    spec = _load_or_explain(None)
    if spec is None:
        return 2
    text = render_markdown(spec)
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run `pdflow spec render`", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0
