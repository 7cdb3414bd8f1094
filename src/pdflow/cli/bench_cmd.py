"""`pdflow bench`: run the benchmark suites side by side; write results.json and PNG plots."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

    from pdflow.bench.runner import BenchReport, Check

DEFAULT_OUT = Path("out/bench")
_PIPED_WIDTH = 140


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pdflow.bench.runner import SUITES  # standard library only: cheap at start-up

    parser = sub.add_parser(
        "bench",
        help="side-by-side benchmarks, written as JSON and PNG plots",
        description="Run the benchmark suites (control plane, data plane, heterogeneous TP, "
        "pure core) in one run, print each ratio against its target and write results.json "
        "and one PNG per suite. Run it from the repository root (it needs benchmarks/).",
    )
    parser.add_argument(
        "--suite",
        dest="suites",
        action="append",
        choices=SUITES,
        help="run only this suite (repeatable; default: all of them)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, done in well under a minute"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder (default %(default)s)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from pdflow.bench.plots import write_plots
    from pdflow.bench.runner import SUITES, SuiteResult, run_bench

    suites = list(dict.fromkeys(args.suites or SUITES))
    console = Console()
    if not console.is_terminal:
        console = Console(width=_PIPED_WIDTH)  # logs and CI: keep the summary table legible
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("starting", total=len(suites))

        def on_suite(name: str, result: SuiteResult | None) -> None:
            if result is None:
                bar.update(task, description=f"suite [bold]{name}[/]")
                return
            bar.advance(task)
            console.log(f"suite {name}: {result.status} in {result.seconds:.1f} s {result.detail}")

        with _warnings_only():
            report = run_bench(suites, quick=args.quick, progress=console.log, on_suite=on_suite)

    args.out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, args.out)
    results = args.out / "results.json"
    document = report.to_json() | {"plots": [path.name for path in plots]}
    results.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    console.print(summary_table(report))
    console.print(f"wrote {results} and {len(plots)} plot(s): {', '.join(p.name for p in plots)}")
    return 1 if any(suite.status == "error" for suite in report.suites) else 0


@contextlib.contextmanager
def _warnings_only() -> Iterator[None]:
    """Keep the nodes' per-room info logs off the progress display (and out of the timings)."""
    import structlog

    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**saved)


def _figure(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:,.0f} {unit}"


def _target(check: Check) -> str:
    if check.target is None:
        return "-"
    return f"{'≥' if check.higher_is_better else '≤'} {_figure(check.target, check.unit)}"


_VERDICT_STYLE = {"pass": "bold green", "miss": "bold red", "info": "dim"}


def summary_table(report: BenchReport) -> Table:
    """Each judged figure with its target and verdict, and every suite that did not run."""
    from rich.table import Table

    title = "pdflow bench" + (
        " (quick: small sizes, not comparable to targets)" if report.quick else ""
    )
    table = Table(title=title)
    for column in ("suite", "measure", "value", "target", "result", "baseline"):
        table.add_column(column, justify="right" if column in ("value", "target") else "left")
    for suite in report.suites:
        if suite.status != "ok":
            style = "bold red" if suite.status == "error" else "yellow"
            table.add_row(suite.name, suite.detail, "", "", f"[{style}]{suite.status}[/]", "")
            continue
        for check in suite.checks:
            verdict = check.verdict
            table.add_row(
                suite.name,
                check.measure,
                _figure(check.value, check.unit),
                _target(check),
                f"[{_VERDICT_STYLE[verdict]}]{verdict}[/]",
                check.baseline,
            )
    return table
