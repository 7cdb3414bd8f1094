"""The `pdflow` command line. Each sub-command lives in its own module with a `register()`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Sub-command modules, imported lazily so `pdflow spec check` does not pay for torch or zmq.
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
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
