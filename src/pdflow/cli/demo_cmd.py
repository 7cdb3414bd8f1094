"""`pdflow demo`: the main job. A real prefill (TP=2) and decode (TP=1) on loopback."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="run a real prefill and decode on loopback moving a tiny transformer's KV",
        description=(
            "Starts a prefill instance (KV laid out as TP=2) serving its bootstrap registry, a "
            "decode instance (TP=1, so heterogeneous-TP staging is used) and a router; each "
            "request's KV moves through pdflow and the decode's tokens must equal a "
            "single-process run of the same model."
        ),
    )
    demo.add_argument("--requests", type=int, default=12, help="number of requests (default 12)")
    demo.add_argument("--prompt-len", type=int, default=40, help="prompt tokens (default 40)")
    demo.add_argument("--max-new", type=int, default=12, help="tokens to generate (default 12)")
    demo.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    demo.add_argument("--transport", choices=("auto", "mooncake", "inprocess"), default="auto",
                      help="auto: Mooncake TCP when installed, else in-process")
    demo.add_argument("--faults", action="store_true",
                      help="inject decode aborts and stop the prefill mid-run, then recover")
    demo.add_argument("--seed", type=int, default=0, help="seed for weights, prompts and faults")
    demo.add_argument("--out", default="out/demo", help="where traces go (default out/demo)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON only")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdflow.demo.cli_view import run_and_show
    from pdflow.demo.run import DemoOptions

    for name in ("requests", "prompt_len", "max_new", "concurrency"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    options = DemoOptions(
        requests=args.requests, prompt_len=args.prompt_len, max_new=args.max_new,
        concurrency=args.concurrency, transport=args.transport, faults=args.faults,
        seed=args.seed, out_dir=args.out,
    )  # fmt: skip
    return run_and_show(options, as_json=args.json)
