"""The demo's closing lines: the replay and timeline commands come out whole, to copy."""

from __future__ import annotations

import shlex

from rich.console import Console

from pdflow.demo.cli_view import _show, pdflow_command
from pdflow.demo.run import DemoReport, RequestRecord


def test_the_commands_to_copy_are_one_line_each_however_narrow_the_console() -> None:
    traces = [f"out/demo/traces/{role}-0123456789abcdef#0.jsonl" for role in ("prefill", "decode")]
    report = DemoReport(
        transport="inprocess", requests=2, succeeded=2, tokens_equal=True, attempts=2,
        tokens_generated=8, bytes_moved=1024, kv_bytes=768, state_bytes=256,
        transfer_gbps=None, transport_busy_s=0.0, handshake_ms_p50=None,
        handshake_ms_p99=None, ttft_ms_p50=None, ttft_ms_p99=None, pages_quarantined=0,
        pages_held_for_dead_writers=0, pages_leaked=0, faults=[], injected=[], traces=traces,
        timeline="out/demo/timeline.html", wall_s=1.0,
        records=[RequestRecord(index=0, room=7001, ok=True),
                 RequestRecord(index=1, room=7002, failures=["aborted"])],
    )  # fmt: skip
    console = Console(width=60, record=True)
    _show(console, report)
    lines = console.export_text().splitlines()
    files = " ".join(shlex.quote(trace) for trace in traces)  # '#' starts a shell comment
    pdflow = pdflow_command()
    assert f"  replay:   {pdflow} replay {files}" in lines
    assert f"  timeline: {pdflow} trace show {files} --room 7002" in lines  # the failed one
