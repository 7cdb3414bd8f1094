"""What a chaos run prints and writes: a summary table, ``result.json`` and ``report.html`` (the
fault schedule and every room attempt on one time axis, then the violations with their rooms'
timelines). The page is self-contained (inline SVG, no script)."""

from __future__ import annotations

import html
import shlex
from collections import Counter
from pathlib import Path

import msgspec

from pdflow.chaos.agent_io import MUTANT_VARIABLE
from pdflow.chaos.checker import Violation, ended_incarnations
from pdflow.chaos.nemesis import Applied
from pdflow.chaos.run import ROTATE_QUARANTINE_PERCENT, RunRecord

_WIDTH, _LEFT, _LANE, _PAD = 1100, 150, 7, 14
_OUTCOME_COLOUR = {
    "success": "#2e7d32", "served_prefill_killed": "#66bb6a", "served_prefill_failed": "#c62828",
    "failed": "#c62828", "prefill_killed": "#6a1b9a",
    "aborted_by_decode": "#ef6c00", "aborted_by_prefill": "#f9a825", "not_terminal": "#000000",
}  # fmt: skip
_FAULT_COLOUR = {
    "partition": "#1565c0", "oneway": "#00838f", "kill": "#6a1b9a", "pause": "#5d4037",
    "registry": "#ad1457", "slow": "#9e9d24", "pause_mid_write": "#bf360c",
}  # fmt: skip


def reproduce_command(run: RunRecord) -> str:
    """The command line that runs this seed again as it ran: the ``PDFLOW_*`` environment the
    agents read, and ``--loopback`` whenever it ran on loopback (asked for, or fallen back to)."""
    options = run.options
    environment = dict(run.environment)
    if run.mutant:
        environment.setdefault(MUTANT_VARIABLE, run.mutant)
    prefix = "".join(f"{name}={shlex.quote(value)} " for name, value in sorted(environment.items()))
    return (f"{prefix}pdflow chaos --seed {options.seed} --duration {options.duration_s:g} "
            f"--nemesis {','.join(options.nemesis) or 'none'} --rate {options.rate_per_s:g} "
            f"--aborts {','.join(options.aborts) or 'none'}"
            + ("" if run.network == "netns" else " --loopback"))


def summary_rows(run: RunRecord, violations: list[Violation]) -> list[tuple[str, str]]:
    work = [a for a in run.attempts if not a.probe]
    outcomes = Counter(a.outcome for a in work)
    requests = {a.request for a in work}
    served = {a.request for a in work if a.served}
    faults = Counter(f.fault.kind for f in run.faults if f.applied)
    failed_faults = [f for f in run.faults if f.error]
    skipped = Counter(f.fault.kind for f in run.faults if f.skipped)
    late = [f.late_s for f in run.faults if f.applied and f.late_s is not None]
    kinds = Counter(v.kind for v in violations)
    probes = [a for a in run.attempts if a.probe]
    return [
        ("seed / duration", f"{run.options.seed} / {run.options.duration_s:.0f}s "
                            f"(wall {run.wall_s:.0f}s)"),
        ("network", f"{run.network} ({len(run.addresses)} hosts)"),
        ("requests", f"{len(run.plan)} planned, {len(requests)} run, {len(served)} served, "
                     f"{len(run.shed)} shed"),
        ("room attempts", f"{len(work)}: " + ", ".join(f"{k} {v}" for k, v in
                                                      sorted(outcomes.items()))),
        ("room ids reused", f"{sum(a.generation > 0 for a in work)} attempts at generation > 0 "
                            "(retries and reuse of finished rooms)"),
        ("bytes verified", f"{sum(a.tokens for a in work if a.served)} tokens "
                           "in successful rooms, checked byte by byte"),
        ("recovery probes", f"{sum(a.outcome == 'success' for a in probes)}/{len(probes)} "
                            "attempts succeeded"),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(faults.items())) or "none"),
        ("faults that failed to apply", str(len(failed_faults)) + "".join(
            f"; {f.fault.describe()}: {f.error}" for f in failed_faults[:3])),
        ("faults skipped", ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
                           + " (the network cannot inject them)" if skipped else "none"),
        ("faults that failed to heal", str(sum(bool(f.heal_error) for f in run.faults))),
        ("fault start lateness", f"at most {max(late):.2f}s (each ran its planned length from "
                                 "its actual start)" if late else "none started"),
        ("pages held for ended lives", f"{_held_for_ended(run)} pages quarantined at the end "
                                      "for writers whose process life ended (under the "
                                      f"{ROTATE_QUARANTINE_PERCENT:g}% rotation threshold)"),
        ("engine rotations", ", ".join(f"{n} {s.get('rotations', 0)}"
                                       for n, s in sorted(run.final_state.items())
                                       if n.startswith("decode"))),
        ("process lives", ", ".join(f"{n} {len(lives)}" for n, lives in run.lives.items())),
        ("traces replayed", f"{sum(r.returncode == 0 for r in run.replays)}/{len(run.replays)} OK"),
        ("violations", f"{len(violations)}" + (": " + ", ".join(
            f"{k} {v}" for k, v in sorted(kinds.items())) if violations else "")),
    ]  # fmt: skip


def _held_for_ended(run: RunRecord) -> int:
    ended = ended_incarnations(run)
    return sum(held["pages"] for state in run.final_state.values()
               for rank in state.get("ranks", []) for held in rank["quarantine"]
               if all(w[1] in ended for w in held["waiting_on"]))  # fmt: skip


def write_result(run: RunRecord, violations: list[Violation], out: Path) -> Path:
    path = out / "result.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(
        {"violations": violations, "summary": dict(summary_rows(run, violations)), "run": run}
    )))  # fmt: skip
    return path


def write_html(run: RunRecord, violations: list[Violation], out: Path) -> Path:
    path = out / "report.html"
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                   for k, v in summary_rows(run, violations))  # fmt: skip
    faults = "".join(
        f"<tr><td>{f.fault.at:.1f}-{f.fault.end:.1f}</td><td>{_span(f.started, f.healed)}</td>"
        f"<td>{f.fault.duration:.1f}</td><td>{f.fault.kind}</td>"
        f"<td>{html.escape(f.fault.target)}{' &rarr; ' + f.fault.peer if f.fault.peer else ''}"
        f"</td><td>{html.escape(_fault_problems(f))}</td></tr>"
        for f in run.faults
    )  # fmt: skip
    found = "".join(
        f"<details><summary><b>{v.kind}</b> {html.escape(v.process or '')} room {v.room} "
        f"gen {v.generation} t={'' if v.t is None else f'{v.t:.1f}s'}: "
        f"{html.escape(v.detail[:300])}</summary><pre>{html.escape(v.timeline)}</pre></details>"
        for v in violations
    ) or "<p>none</p>"  # fmt: skip
    means = "".join(f"<li>{k}: {html.escape(v)}</li>" for k, v in run.fault_means.items()
                    if k not in run.unavailable)  # fmt: skip
    missing = "".join(f"<li>{html.escape(v)}</li>" for v in run.unavailable.values())
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>pdflow chaos seed {run.options.seed}</title><style>
body{{font-family:sans-serif;margin:16px}} table{{border-collapse:collapse;margin:8px 0}}
th,td{{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}}
pre{{font-size:11px;background:#f6f6f6;padding:6px;overflow-x:auto}}
.legend span{{display:inline-block;margin-right:12px;font-size:12px}}
</style></head><body>
<h1>pdflow chaos: seed {run.options.seed}, {len(violations)} violations</h1>
<p>Reproduce: <code>{html.escape(reproduce_command(run))}</code> (the schedule is in
<code>schedule.json</code>, the whole history in <code>result.json</code>)</p>
<table>{rows}</table>
<h2>Faults and rooms on one time axis</h2>
{_legend()}
{_timeline_svg(run, violations)}
<h2>Fault schedule (written before the run)</h2>
<table><tr><th>planned (s)</th><th>actual (s)</th><th>for (s)</th><th>kind</th><th>target</th>
<th>error</th></tr>
{faults}</table>
<p>How faults were made:</p><ul>{means}</ul>
{f"<p>Faults that cannot be injected here:</p><ul>{missing}</ul>" if missing else ""}
<h2>Violations</h2>{found}
</body></html>"""
    path.write_text(page)
    return path


def _fault_problems(f: Applied) -> str:
    return "; ".join(filter(None, (f.error, f.skipped and f"skipped: {f.skipped}",
                                   f.heal_error and f"heal failed: {f.heal_error}")))  # fmt: skip


def _span(start: float | None, end: float | None) -> str:
    if start is None:
        return "-"
    return f"{start:.1f}-" + ("" if end is None else f"{end:.1f}")


def _legend() -> str:
    items = [*(f'<span style="color:{c}">&#9632; {k}</span>' for k, c in _FAULT_COLOUR.items()),
             *(f'<span style="color:{c}">&#9632; room {k}</span>'
               for k, c in _OUTCOME_COLOUR.items())]  # fmt: skip
    return f'<div class="legend">{"".join(items)}<span style="color:red">&#9660; violation'\
           "</span></div>"


def _timeline_svg(run: RunRecord, violations: list[Violation]) -> str:
    ends = [a.decode_done or a.prefill_done or a.started for a in run.attempts]
    horizon = max([run.workload_end, *ends, *(f.fault.end for f in run.faults),
                   *(f.healed for f in run.faults if f.healed is not None)], default=1.0)
    scale = (_WIDTH - _LEFT - 10) / max(horizon, 1e-6)

    def x(t: float) -> float:
        return _LEFT + t * scale

    parts: list[str] = []
    y = 20
    # time axis
    step = 10 if horizon > 30 else 5
    for tick in range(0, int(horizon) + 1, step):
        parts.append(f'<line x1="{x(tick):.1f}" y1="12" x2="{x(tick):.1f}" y2="100%" '
                     'stroke="#eee"/>'
                     f'<text x="{x(tick):.1f}" y="10" font-size="9">{tick}s</text>')  # fmt: skip
    hosts = list(run.addresses)
    for host in hosts:
        parts.append(f'<text x="4" y="{y + 9}" font-size="11">fault: {host}</text>')
        for f in run.faults:
            if host in (f.fault.target, f.fault.peer) and not f.skipped:  # as it ran
                start = f.started if f.started is not None else f.fault.at
                end = f.healed if f.healed is not None else f.fault.end
                colour = _FAULT_COLOUR.get(f.fault.kind, "#999")
                width = max(1.0, (end - start) * scale)
                parts.append(
                    f'<rect x="{x(start):.1f}" y="{y}" width="{width:.1f}" height="10" '
                    f'fill="{colour}"><title>{html.escape(f.fault.describe())}</title></rect>'
                )
        y += _PAD
    y += 6
    groups: dict[str, list[tuple[float, float, str, str]]] = {}
    for a in run.attempts:
        end = max(a.decode_done or 0.0, a.prefill_done or 0.0, a.started + 0.05)
        label = f"room {a.room} gen {a.generation} {a.prefill}->{a.decode}: {a.outcome}"
        groups.setdefault(f"{a.prefill} -> {a.decode}", []).append(
            (a.started, end, a.outcome, label))
    for name in sorted(groups):
        lanes: list[float] = []
        bars = []
        for start, end, outcome, label in sorted(groups[name]):
            lane = next((i for i, busy in enumerate(lanes) if busy <= start), len(lanes))
            if lane == len(lanes):
                lanes.append(0.0)
            lanes[lane] = end
            bars.append(
                f'<rect x="{x(start):.1f}" y="{y + lane * _LANE}" '
                f'width="{max(1.0, (end - start) * scale):.1f}" height="{_LANE - 1}" '
                f'fill="{_OUTCOME_COLOUR.get(outcome, "#999")}"><title>{html.escape(label)}'
                "</title></rect>"
            )  # fmt: skip
        parts.append(f'<text x="4" y="{y + 9}" font-size="11">{html.escape(name)}</text>')
        parts.extend(bars)
        y += max(1, len(lanes)) * _LANE + 8
    for v in violations:
        if v.t is not None:
            parts.append(f'<text x="{x(v.t) - 4:.1f}" y="{y + 10}" fill="red" font-size="12">'
                         f"&#9660;<title>{html.escape(v.kind + ': ' + v.detail[:200])}</title>"
                         "</text>")  # fmt: skip
    y += 20
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{y}" '
            f'style="border:1px solid #ddd">{"".join(parts)}</svg>')  # fmt: skip
