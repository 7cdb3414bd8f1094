"""`pdflow check`: model-check the protocol with seeded simulated worlds.

Each example is one seed: it draws a world (topology, policy, fault mix) and drives it for
``--steps`` actions, checking every invariant after every core step, then settles it and checks
liveness. A failure prints its seed and writes the trace that reproduces it. ``--mutants`` runs
the checker against deliberately broken cores and reports how fast each is caught.
"""

from __future__ import annotations

import argparse
import re
import shlex
import time
from collections import Counter
from pathlib import Path
from typing import Any

DEFAULT_TRACE_DIR = Path("pdflow-check-traces")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = sub.add_parser("check", help="model-check the protocol in simulated worlds")
    check.add_argument("--seed", type=int, default=0, help="first seed (examples use seed+i)")
    check.add_argument("--examples", type=int, default=None,
                       help="worlds to run (default 100; 200 per mutant with --mutants)")
    check.add_argument("--steps", type=int, default=300, help="actions per world (default 300)")
    check.add_argument("--mutants", action="store_true", help="check that every mutant is caught")
    check.add_argument("--mutant", action="append", default=[], metavar="NAME",
                       help="with --mutants: only this mutant (repeatable); its catching run's "
                            "trace is written and a command that reproduces it printed")
    check.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help=f"where failing runs' traces are written (default {DEFAULT_TRACE_DIR}/; with "
             "--mutants, only when given or with --mutant)",
    )
    check.set_defaults(run=run_check)


def run_check(args: argparse.Namespace) -> int:
    if args.examples is None:
        args.examples = 200 if args.mutants else 100
    if args.examples < 1 or args.steps < 1:
        print("--examples and --steps must be at least 1")
        return 2
    if args.mutant and not args.mutants:
        print("--mutant NAME needs --mutants")
        return 2
    if args.trace_dir is not None and args.trace_dir.exists() and not args.trace_dir.is_dir():
        print(f"--trace-dir {args.trace_dir} is a file; give a folder (created if missing)")
        return 2
    if args.mutants:
        return _run_mutants(args)
    args.trace_dir = args.trace_dir or DEFAULT_TRACE_DIR
    return _run_examples(args)


def _progress() -> object:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )


def _run_examples(args: argparse.Namespace) -> int:
    from pdflow.sim.cells import cell_coverage
    from pdflow.sim.coverage import (
        DRIVEN_MACHINES,
        PROTOCOL_MACHINES,
        cell_only,
        missing,
        reachable_summary,
        summary,
    )
    from pdflow.sim.invariants import INVARIANTS
    from pdflow.sim.runner import run_seed

    coverage: Counter[tuple[str, str, str, str | None, str]] = Counter()
    checked: Counter[str] = Counter()
    steps = checks = actions = mismatched = 0
    failures = []
    started = time.perf_counter()
    with _progress() as progress:  # type: ignore[attr-defined]
        task = progress.add_task("model checking", total=args.examples)
        for seed in range(args.seed, args.seed + args.examples):
            result, world = run_seed(seed, args.steps, trace_dir=args.trace_dir)
            coverage.update(world.monitor.coverage)
            steps += result.core_steps
            checks += result.invariant_checks
            checked.update(result.checked)
            actions += result.actions
            mismatched += world.shape.checksum_mismatch
            if not result.ok:
                failures.append(result)
            progress.advance(task)
    elapsed = time.perf_counter() - started
    print(
        f"examples: {args.examples} (seeds {args.seed}..{args.seed + args.examples - 1}), "
        f"{args.steps} actions each"
    )
    print(f"actions: {actions}, core steps: {steps}, invariant checks: {checks} (each time an "
          f"invariant's check ran)")
    never = [invariant for invariant in INVARIANTS if not checked[invariant]]
    print(f"invariants checked at least once: {len(INVARIANTS) - len(never)}/{len(INVARIANTS)}"
          + (f" (never: {', '.join(never)})" if never else ""))
    print(f"checksum-mismatch worlds (every room that gets that far must fail saying so): "
          f"{mismatched}")
    print(f"speed: {steps / elapsed:,.0f} simulated core steps/s ({elapsed:.1f} s)")
    for failure in failures:  # first: what to look at, before the coverage figures
        _show_failure(failure, args)
    protocol = ", ".join(PROTOCOL_MACHINES)
    combined = coverage + cell_coverage()
    print(f"spec coverage of the protocol machines ({protocol}):")
    print(f"  worlds alone:           {summary(coverage, PROTOCOL_MACHINES)}; "
          f"{reachable_summary(coverage, PROTOCOL_MACHINES)}")
    print(f"  worlds + cell drives:   {summary(combined, PROTOCOL_MACHINES)}")
    print(f"  only a cell drive reaches {len(cell_only())} (spec/README.md, 'Coverage')")
    others = [m for m in DRIVEN_MACHINES if m not in PROTOCOL_MACHINES]
    print(f"  also driven ({', '.join(others)}; exhaustive tests of their own): "
          f"{summary(coverage, others)}")
    unreached = missing(combined, PROTOCOL_MACHINES)
    if unreached:
        # Short runs may miss rare rows; CI's test_spec_coverage requires them all.
        print(f"not reached in this run ({len(unreached)}; run more --examples):")
        for line in unreached:
            print(f"  {line}")
    if failures:
        seeds = ", ".join(str(failure.seed) for failure in failures[:10])
        print(f"\nFAILED: {len(failures)} of {args.examples} worlds broke an invariant (seeds "
              f"{seeds}{', ...' if len(failures) > 10 else ''}); each is shown above the coverage")
        return 1
    print("all invariants held")
    return 0


def _show_failure(failure: Any, args: argparse.Namespace) -> None:
    """One failed world: its violations, the command that runs it again, and the trace tools."""
    trace_dir = "" if args.trace_dir == DEFAULT_TRACE_DIR else f" --trace-dir {args.trace_dir}"
    print(f"\nFAILED seed {failure.seed}: reproduce with `pdflow check --seed {failure.seed} "
          f"--examples 1 --steps {args.steps}{trace_dir}`")  # fmt: skip
    for violation in failure.violations[:10]:
        print(f"  - {violation}")
    if failure.simulator_error is not None:
        print("  a bug of the simulator (pdflow.sim), not a protocol finding; fix it there:")
        print("    " + failure.simulator_error.strip().replace("\n", "\n    "))
    if failure.trace_path:
        print(f"  trace: {failure.trace_path}")
        print(f"  {replay_hint(failure.trace_path, failure.violations)}")
        print(f"  its rooms' timelines: pdflow trace show {failure.trace_path}")


_ROOM_IN_VIOLATION = re.compile(r"\broom (\d+)/\d+")
_ENDPOINT_IN_VIOLATION = re.compile(r"\[\w+\] (\S+): ")
"""Violations read ``t=T: [invariant] endpoint: ... room R/G ...`` (pdflow.sim.invariants;
liveness ones start ``liveness: [invariant]``)."""


def replay_hint(trace: str, violations: list[str]) -> str:
    """The replay command that steps through what the violations name: their rooms, else the
    endpoint named first, else every step."""
    from pdflow.trace.merge import load_traces

    path = shlex.quote(trace)
    rooms = sorted({int(room) for v in violations for room in _ROOM_IN_VIOLATION.findall(v)})
    if rooms:
        follow = "".join(f" --room {room}" for room in rooms[:3])
        return f"step through room {', '.join(map(str, rooms[:3]))} as replayed: " \
               f"pdflow replay {path}{follow}"  # fmt: skip
    endpoints = load_traces([Path(trace)]).headers
    named = [m.group(1) for v in violations if (m := _ENDPOINT_IN_VIOLATION.search(v))]
    for endpoint in named:
        if endpoint in endpoints:
            return (f"step through {endpoint} as replayed: pdflow replay {path} --endpoint "
                    f"{shlex.quote(endpoint)}")  # fmt: skip
    return f"step through it as replayed: pdflow replay {path} --all-steps"


def _run_mutants(args: argparse.Namespace) -> int:
    from pdflow.sim.mutants import MUTANTS, applied
    from pdflow.sim.runner import run_seed

    known = {mutant.name for mutant in MUTANTS}
    unknown = [name for name in args.mutant if name not in known]
    if unknown:
        print(f"no mutant {', '.join(unknown)}; the mutants are: {', '.join(sorted(known))}")
        return 2
    chosen = [mutant for mutant in MUTANTS if not args.mutant or mutant.name in args.mutant]
    trace_dir = args.trace_dir or (DEFAULT_TRACE_DIR if args.mutant else None)
    escaped = []
    broken: dict[str, tuple[int, str]] = {}
    """Mutants under which the simulator itself raised: neither caught nor escaped."""
    with _progress() as progress:  # type: ignore[attr-defined]
        task = progress.add_task("mutants", total=len(chosen))
        rows = []
        for mutant in chosen:
            actions = 0
            caught = None
            with applied(mutant):
                first = args.seed + mutant.first_seed
                for seed in range(first, first + args.examples):
                    result, _ = run_seed(seed, args.steps, record=False)
                    actions += result.actions
                    if result.simulator_error is not None:
                        broken[mutant.name] = (seed, result.simulator_error)
                        break
                    if not result.ok:
                        trace: str | None = None
                        if trace_dir is not None:  # the same seed again, recorded this time
                            # A folder per mutant: two caught at one seed must not share a file.
                            mutant_dir = trace_dir / mutant.name
                            trace = run_seed(seed, args.steps, trace_dir=mutant_dir,
                                             mutant=mutant.name)[0].trace_path
                        caught = (seed, result.first_problem, trace or "")
                        break
            rows.append((mutant, caught, actions))
            if caught is None and mutant.name not in broken:
                escaped.append(mutant.name)
            progress.advance(task)
    for mutant, caught, actions in rows:
        if mutant.name in broken:
            seed, error = broken[mutant.name]
            print(f"SIMBUG  {mutant.name}: the simulator itself raised at seed {seed} (not a "
                  f"catch; fix pdflow.sim; reproduce: pdflow check --mutants --mutant "
                  f"{mutant.name} --seed {seed - mutant.first_seed} --examples 1 --steps "
                  f"{args.steps}):\n{error.rstrip()}")
        elif caught is None:
            print(f"ESCAPED {mutant.name} ({mutant.bug_class}) after {actions} actions")
        else:
            print(
                f"caught  {mutant.name:32} seed {caught[0]:4} after {actions:6} actions: "
                f"{caught[1][:110]}"
            )
            if args.mutant:
                print(f"  reproduce: pdflow check --mutants --mutant {mutant.name} --seed "
                      f"{caught[0] - mutant.first_seed} --examples 1 --steps {args.steps}"
                      + (f"; trace: {caught[2]}" if caught[2] else ""))
                if caught[2]:
                    print(f"  {replay_hint(caught[2], [caught[1]])}")
    caught_count = sum(caught is not None for _, caught, _ in rows)
    print(f"{caught_count}/{len(chosen)} mutants caught")
    return 1 if escaped or broken else 0
