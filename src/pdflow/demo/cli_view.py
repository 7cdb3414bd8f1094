"""What `pdflow demo` prints: a progress bar, then a summary and the trace commands."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import structlog
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdflow.demo.run import DemoOptions, DemoReport, run_demo


def _quiet_logs() -> None:
    """The nodes log JSON lines for operators; the demo shows a summary instead."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's C++ INFO lines


@contextlib.contextmanager
def _engine_chatter_to(path: Path) -> Iterator[None]:
    """Send what native code writes on fd 2 (Mooncake's C++ INFO lines) to a log file, so the
    progress bar stays readable; Python's own errors are still shown (see run_and_show)."""
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
    chatter = contextlib.nullcontext() if as_json else _engine_chatter_to(engine_log)
    with Progress(
        TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=as_json, disable=as_json,
    ) as progress:  # fmt: skip
        task = progress.add_task("requests", total=options.requests)

        def on_progress(done: int) -> None:
            progress.update(task, completed=done)

        def notes(text: str) -> None:
            if not as_json:
                progress.console.print(f"[dim]-[/dim] {text}")

        try:
            with chatter:
                report = anyio.run(run_demo, options, on_progress, notes, backend="asyncio")
        except BaseException:
            if not as_json:
                console.print(f"[red]the demo crashed; native engine output is in {engine_log}")
            raise
    unexplained = report.pages_quarantined - report.pages_held_for_dead_writers
    ok = report.tokens_equal and unexplained == 0 and report.pages_leaked == 0
    if as_json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _show(console, report)
        console.print(f"  native engine log: {engine_log}")
    if not ok:
        console.print("[bold red]DEMO FAILED[/bold red]: "
                      + ("decode tokens differ from the single-process run; "
                         if not report.tokens_equal else "")
                      + (f"{unexplained} pages quarantined without cause, "
                         f"{report.pages_leaked} leaked" if unexplained
                         or report.pages_leaked else ""))  # fmt: skip
        for record in report.records:
            if not record.ok or record.tokens != record.expected:
                console.print(f"  request {record.index} room {record.room}: "
                              f"got {record.tokens} expected {record.expected}; "
                              f"{'; '.join(record.failures)}")  # fmt: skip
    return 0 if ok else 1


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
        ("tokens", f"{report.tokens_generated} generated; equal to single-process: {equal}"),
        ("bytes moved", f"{report.bytes_moved:,} B of KV"),
        ("transfer", f"{_fmt(report.transfer_gbps, ' GB/s')} "
                     "(over transport time, staged TP=2 -> TP=1)"),
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
        files = " ".join(report.traces)
        console.print("[bold]traces[/bold]")
        for path in report.traces:
            console.print(f"  {path}")
        # Commands to copy: never wrapped at the console's width, never parsed as markup.
        console.print(f"  replay:   pdflow replay {files}", soft_wrap=True, markup=False)
        console.print(f"  timeline: pdflow trace show {files} --room R", soft_wrap=True,
                      markup=False)  # fmt: skip
    if report.timeline:
        console.print(f"[bold]timeline page[/bold] (open in a browser): {report.timeline}",
                      soft_wrap=True)  # fmt: skip
