"""What `pdflow demo` prints: a progress bar, then a summary and the trace commands."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import msgspec
import structlog
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdflow.demo.run import DemoOptions, DemoReport, run_demo


def _quiet_logs() -> None:
    """The nodes log JSON lines for operators; the demo shows a summary instead. What they
    still log (warnings) goes to stderr, never stdout: with --json stdout is the report alone,
    and during the run stderr is the engine log (_engine_chatter_to)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's C++ INFO lines


@contextlib.contextmanager
def _engine_chatter_to(path: Path) -> Iterator[None]:
    """Send what is written on fd 2 during the run (Mooncake's C++ lines, the nodes' warnings)
    to a log file, so the progress bar stays readable and --json's stderr holds only errors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def run_and_show(options: DemoOptions, *, as_json: bool) -> int:
    _quiet_logs()
    console = Console(stderr=as_json)
    engine_log = Path(options.out_dir) / "engine.log"
    try:
        with Progress(
            TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=as_json, disable=as_json,
        ) as progress:  # fmt: skip
            task = progress.add_task("requests", total=options.requests)

            def on_progress(done: int) -> None:
                progress.update(task, completed=done)

            def notes(text: str) -> None:
                if not as_json:
                    progress.console.print(f"[dim]-[/dim] {text}")

            with _engine_chatter_to(engine_log):
                report = anyio.run(run_demo, options, on_progress, notes, backend="asyncio")
    except KeyboardInterrupt:
        traces = shlex.quote(str(Path(options.out_dir) / "traces"))
        print(f"interrupted; partial traces in {traces}", file=sys.stderr)
        return 130
    except BaseException:
        print(f"the demo crashed; native engine output is in {engine_log}", file=sys.stderr)
        raise
    unexplained = report.pages_quarantined - report.pages_held_for_dead_writers
    ok = report.tokens_equal and unexplained == 0 and report.pages_leaked == 0
    if as_json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _show(console, report)
        console.print(f"  native engine log: {engine_log}")
    if not ok:
        _show_failure(console, report, unexplained)
    return 0 if ok else 1


def _show_failure(console: Console, report: DemoReport, unexplained: int) -> None:
    failed = [r for r in report.records if not r.ok]
    differ = [r for r in report.records if r.ok and r.tokens != r.expected]
    problems = []
    if failed:
        problems.append(f"{_count(failed, 'request')} failed every attempt")
    if differ:
        problems.append(f"{_count(differ, 'request')}: decode tokens differ from the "
                        "single-process run")  # fmt: skip
    if unexplained or report.pages_leaked:
        problems.append(f"{unexplained} pages quarantined without cause, "
                        f"{report.pages_leaked} leaked")  # fmt: skip
    console.print("[bold red]DEMO FAILED[/bold red]: " + "; ".join(problems))
    for record in failed:
        console.print(f"  request {record.index} room {record.room}: failed "
                      f"{record.attempts} attempts: {'; '.join(record.failures)}",
                      markup=False)  # fmt: skip
    for record in differ:
        console.print(f"  request {record.index} room {record.room}: got {record.tokens} "
                      f"expected {record.expected}", markup=False)  # fmt: skip


def _count(items: Sequence[object], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def pdflow_command() -> str:
    """How to run pdflow from a pasted line: `pdflow` when that is this installation on PATH,
    else the script this run was started with, else this interpreter with -m."""
    here = Path(sys.executable).parent
    on_path = shutil.which("pdflow")
    if on_path is not None and Path(on_path).absolute().parent == here.absolute():
        return "pdflow"
    if Path(sys.argv[0]).name == "pdflow":
        return shlex.quote(sys.argv[0])
    return f"{shlex.quote(sys.executable)} -m pdflow.cli"


def trace_room(report: DemoReport) -> int | None:
    """The room worth drawing first: the first that failed an attempt, else the first."""
    for record in report.records:
        if record.failures:
            return record.room
    return report.records[0].room if report.records else None


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def _show(console: Console, report: DemoReport) -> None:
    table = Table(title="pdflow demo", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    equal = "[green]yes[/green]" if report.tokens_equal else "[red]NO[/red]"
    rows = [
        ("transport", report.transport),
        ("requests", f"{report.succeeded}/{report.requests} succeeded "
                     f"({report.attempts} attempts)"),
        ("tokens", f"{report.tokens_generated} generated (first token on the prefill); "
                   f"equal to single-process: {equal}"),
        ("bytes moved", f"{report.bytes_moved:,} B: {report.kv_bytes:,} B of KV pages, "
                        f"{report.state_bytes:,} B of model state"),
        ("transfer", f"{_fmt(report.transfer_gbps, ' GB/s')} over the "
                     f"{report.transport_busy_s * 1e3:.1f} ms some write was in flight "
                     "(staged TP=2 -> TP=1)"),
        ("handshake", f"p50 {_fmt(report.handshake_ms_p50, ' ms')}, "
                      f"p99 {_fmt(report.handshake_ms_p99, ' ms')}"),
        ("TTFT", f"p50 {_fmt(report.ttft_ms_p50, ' ms')}, p99 {_fmt(report.ttft_ms_p99, ' ms')}"),
        ("pages quarantined", f"{report.pages_quarantined}"
         + (f" ({report.pages_held_for_dead_writers} held for the stopped prefill: "
            "no receiver-side fence)" if report.pages_held_for_dead_writers else "")),
        ("pages leaked", str(report.pages_leaked)),
        ("wall time", f"{report.wall_s:.1f} s"),
    ]  # fmt: skip
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    if report.faults:
        console.print("[bold]faults injected and recovered[/bold]")
        for fault in report.faults:
            console.print(f"  - {fault}")
    if report.traces:
        files = " ".join(shlex.quote(path) for path in report.traces)
        pdflow = pdflow_command()
        console.print("[bold]traces[/bold]")
        for path in report.traces:
            console.print(f"  {path}", markup=False)
        # Commands to paste: never wrapped at the console's width, never parsed as markup.
        console.print(f"  replay:   {pdflow} replay {files}", soft_wrap=True, markup=False)
        room = trace_room(report)
        which = "" if room is None else f" --room {room}"  # no room ran: the summary alone
        console.print(f"  timeline: {pdflow} trace show {files}{which}",
                      soft_wrap=True, markup=False)  # fmt: skip
    if report.timeline:
        console.print(f"[bold]timeline page[/bold] (open in a browser): {report.timeline}",
                      soft_wrap=True)  # fmt: skip
