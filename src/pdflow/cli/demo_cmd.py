"""`pdflow demo`: the main job. A real prefill (TP=2) and decode (TP=1) on loopback."""

from __future__ import annotations

import argparse
import sys

from pdflow.demo.limits import UPPER_BOUNDS


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
    top = {name: f"at most {value:,}" for name, value in UPPER_BOUNDS.items()}
    demo.add_argument("--requests", type=int, default=12,
                      help=f"number of requests (default 12, {top['requests']})")  # fmt: skip
    demo.add_argument("--prompt-len", type=int, default=40,
                      help=f"prompt tokens (default 40, {top['prompt_len']})")  # fmt: skip
    demo.add_argument("--max-new", type=int, default=12,
                      help="tokens to generate per request, the prefill's first token included "
                           f"(default 12, {top['max_new']})")  # fmt: skip
    demo.add_argument("--concurrency", type=int, default=4,
                      help=f"requests in flight (default 4, {top['concurrency']})")  # fmt: skip
    demo.add_argument("--transport", choices=("auto", "mooncake", "inprocess"), default="auto",
                      help="auto: Mooncake TCP when installed, else in-process")  # fmt: skip
    demo.add_argument("--faults", action="store_true",
                      help="abort rooms on the decode and stop the prefill, each while a write "
                           "is in flight, then recover")  # fmt: skip
    demo.add_argument("--seed", type=int, default=0,
                      help="seed for weights, prompts and faults (0 to 2**63-1)")  # fmt: skip
    demo.add_argument("--out", default="out/demo", help="where traces go (default out/demo)")
    demo.add_argument("--json", action="store_true", help="print the report as JSON only")
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdflow.demo.cli_view import run_and_show
    from pdflow.demo.run import DemoOptions, check_options

    options = DemoOptions(
        requests=args.requests, prompt_len=args.prompt_len, max_new=args.max_new,
        concurrency=args.concurrency, transport=args.transport, faults=args.faults,
        seed=args.seed, out_dir=args.out,
    )  # fmt: skip
    problem = check_options(options)
    if problem is not None:
        print(f"pdflow demo: {problem}", file=sys.stderr)
        return 2
    return run_and_show(options, as_json=args.json)
