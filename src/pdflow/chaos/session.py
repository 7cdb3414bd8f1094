"""Run, check and report: what `pdflow chaos` does, printed for a person."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
from rich.console import Console
from rich.table import Table

from pdflow.chaos.checker import attach_timelines, check
from pdflow.chaos.netns import remove_owned
from pdflow.chaos.procs import StartFailed, kill_started
from pdflow.chaos.report import reproduce_command, summary_rows, write_html, write_result
from pdflow.chaos.run import ChaosOptions, run_chaos


def run_and_report(options: ChaosOptions) -> int:
    console = Console(highlight=False, width=120)
    _quiet_logs()

    def say(text: str) -> None:
        console.print(f"[dim]chaos:[/] {text}")

    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        run = anyio.run(run_chaos, options, say, backend="asyncio")
    except BaseExceptionGroup as group:
        failed = start_failures(group)
        if not failed:
            raise
        for exc in failed:
            console.print(f"[bold red]pdflow chaos: a process failed to start[/]: {exc}",
                          soft_wrap=True)  # fmt: skip
        return 2
    except StartFailed as exc:
        console.print(f"[bold red]pdflow chaos: a process failed to start[/]: {exc}",
                      soft_wrap=True)  # fmt: skip
        return 2
    finally:
        # The run tears itself down; this catches what an interrupt left behind.
        kill_started()
        remove_owned()
        signal.signal(signal.SIGTERM, previous)
    violations = check(run)
    attach_timelines(run, violations)
    out = Path(options.out_dir)
    result = write_result(run, violations, out)
    page = write_html(run, violations, out)
    table = Table(show_header=False, title=f"pdflow chaos seed {options.seed}")
    for key, value in summary_rows(run, violations):
        table.add_row(key, value)
    console.print(table)
    for violation in violations[:20]:
        console.print(f"[bold red]VIOLATION[/] {violation.kind} ({violation.process}, room "
                      f"{violation.room} gen {violation.generation}, t={violation.t}): "
                      f"{violation.detail}", soft_wrap=True)  # fmt: skip
    if len(violations) > 20:
        console.print(f"... {len(violations) - 20} more in {result}")
    console.print(f"schedule: {out / 'schedule.json'}  result: {result}  page: {page}")
    console.print(f"reproduce: {reproduce_command(run)}")
    return 1 if violations else 0


def start_failures(group: BaseExceptionGroup[BaseException]) -> list[StartFailed]:
    """Every ``StartFailed`` in ``group``, however deep (a start inside a task group inside the
    run's task group nests one group per level), in order."""
    found: list[StartFailed] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found.extend(start_failures(exc))
        elif isinstance(exc, StartFailed):
            found.append(exc)
    return found


def summarize(paths: list[str]) -> int:
    """One row per run's result.json: rooms, faults by kind, violations by kind."""
    import json
    from collections import Counter

    table = Table(title="pdflow chaos runs")
    for column in ("seed", "duration", "nemesis", "network", "attempts", "succeeded", "faults",
                   "violations"):  # fmt: skip
        table.add_column(column)
    total = 0
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"pdflow chaos: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        run = result["run"]
        work = [a for a in run["attempts"] if not a["probe"]]
        ok = sum(bool(a["decode_results"]) and set(a["decode_results"]) == {"Success"}
                 and set(a["prefill_results"]) == {"Success"} for a in work)  # fmt: skip
        faults = Counter(f["fault"]["kind"] for f in run["faults"] if f["started"] is not None
                         and not f.get("error") and not f.get("skipped"))  # fmt: skip
        found = Counter(v["kind"] for v in result["violations"])
        total += len(result["violations"])
        table.add_row(
            str(run["options"]["seed"]), f"{run['options']['duration_s']:g}s",
            ",".join(run["options"]["nemesis"]) or "none", run["network"],
            str(len(work)), str(ok), ", ".join(f"{k} {n}" for k, n in sorted(faults.items())),
            ", ".join(f"{k} {n}" for k, n in sorted(found.items())) or "0",
        )  # fmt: skip
    Console(highlight=False, width=160).print(table)
    return 1 if total else 0


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _quiet_logs() -> None:
    import logging

    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
