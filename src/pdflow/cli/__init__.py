"""The `pdflow` command line. Each sub-command lives in its own module with a `register()`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Sub-command modules, imported lazily so `pdflow spec check` does not pay for torch or zmq.
SIGPIPE_EXIT = 141
"""What a shell reports for a tool stopped by SIGPIPE (128 + 13)."""

COMMANDS = ("demo", "spec", "replay", "trace", "bench", "bootstrap", "check", "chaos")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdflow",
        description="A specified, model-checked protocol core for PD-disaggregated serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"pdflow.cli.{name}_cmd")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
        sys.stdout.flush()  # a pipe buffers: its write fails here, not at interpreter exit
    except BrokenPipeError:
        # The reader went away (`pdflow trace show big.jsonl | head`): stop quietly, as a
        # shell tool does, instead of a traceback; stdout goes nowhere so exit does not retry.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
