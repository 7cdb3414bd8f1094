"""`pdflow chaos`: real processes on separate network namespaces, a seeded nemesis, a checker."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pdflow.chaos.nemesis import KINDS, PAUSE_MID_WRITE

    chaos = sub.add_parser(
        "chaos",
        help="run prefill, decode and registry processes on their own network namespaces "
             "under a seeded nemesis, then check the history",
        description=(
            "Creates one network namespace per host (a registry, two prefill instances with "
            "TP=2, two decode instances), starts each as its own process over Mooncake TCP, "
            "runs a seeded open-loop workload and a seeded fault schedule (written first), "
            "heals, settles and checks: rooms terminal and agreeing, bytes equal, no page "
            "written after release, no page leaked, recovery without restarting a decode, "
            "every trace replays. Exits 1 on any violation. Needs root and iproute2 for "
            "namespaces; otherwise it runs on loopback and says which faults it skips."
        ),
    )  # fmt: skip
    chaos.add_argument("--seed", type=int, default=1, help="one seed reproduces the schedule")
    chaos.add_argument("--duration", type=float, default=60.0,
                       help="seconds of workload and faults (default 60)")
    chaos.add_argument("--nemesis", default=",".join(KINDS),
                       help=f"comma-separated fault kinds (default: {','.join(KINDS)}; "
                            f"{PAUSE_MID_WRITE} only when named); the order is part of the "
                            "seed; 'none' for no faults")
    chaos.add_argument("--rate", type=float, default=3.0, help="requests per second (default 3)")
    chaos.add_argument("--aborts", default="decode,prefill",
                       help="which sides abort about one request in ten each: decode,prefill "
                            "(default), one of them, or 'none'")
    chaos.add_argument("--out", default="out/chaos", help="where everything goes")
    chaos.add_argument("--loopback", action="store_true",
                       help="do not create namespaces (network faults are then skipped)")
    chaos.add_argument("--summarize", nargs="+", metavar="RESULT", default=None,
                       help="run nothing: print one line per run from these result.json files")
    chaos.set_defaults(run=run)


def parse_kinds(text: str) -> tuple[str, ...]:
    from pdflow.chaos.nemesis import ALL_KINDS

    if text.strip() in ("", "none"):
        return ()
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        raise ValueError(f"unknown nemesis kind(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(ALL_KINDS)} or 'none'")
    return kinds


def parse_abort_sides(text: str) -> tuple[str, ...]:
    from pdflow.chaos.workload import ABORT_SIDES

    if text.strip() == "none":
        return ()
    sides = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in sides if s not in ABORT_SIDES]
    if unknown or not sides:
        raise ValueError(f"--aborts {text!r}: choose from {', '.join(ABORT_SIDES)} or 'none'")
    return sides


def run(args: argparse.Namespace) -> int:
    from pdflow.chaos.run import ChaosOptions
    from pdflow.chaos.session import run_and_report, summarize

    if args.summarize:
        return summarize(args.summarize)
    try:
        kinds = parse_kinds(args.nemesis)
        aborts = parse_abort_sides(args.aborts)
    except ValueError as exc:
        print(f"pdflow chaos: {exc}", file=sys.stderr)
        return 2
    if args.duration < 10 or args.rate <= 0:
        print("pdflow chaos: --duration must be at least 10 s and --rate positive",
              file=sys.stderr)
        return 2
    options = ChaosOptions(seed=args.seed, duration_s=args.duration, nemesis=kinds,
                           out_dir=args.out, rate_per_s=args.rate,
                           namespaces=not args.loopback, aborts=aborts)  # fmt: skip
    return run_and_report(options)
