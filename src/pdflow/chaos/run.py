"""One chaos run: hosts, processes, workload and nemesis at once, then heal, settle, probe every
pair, collect the end state, stop every process, replay every trace, check, report.

Everything is torn down on every exit path: processes killed, namespaces deleted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from pdflow.chaos.agent_io import MUTANT_VARIABLE
from pdflow.chaos.nemesis import KINDS, Applied, Fault, Nemesis, plan_faults
from pdflow.chaos.netns import (
    FAULT_MEANS,
    NETWORK_FAULTS,
    Network,
    NetworkError,
    kill_pid,
    open_network,
)
from pdflow.chaos.procs import Agent, trace_files
from pdflow.chaos.workload import ABORT_SIDES, Attempt, PlannedRequest, Router, plan_workload

log = structlog.get_logger("pdflow.chaos")

BOOTSTRAP_PORT = 8998
HEARTBEAT_S, HEARTBEAT_FAILURES = 0.5, 2
HEALTH_READ_TIMEOUT_S = 3.0
"""BootstrapClient's /health read timeout: a stopped process accepts the connection (the kernel
does) and never answers, so each failed probe takes this long."""
DEAD_AFTER_S = HEARTBEAT_FAILURES * (HEARTBEAT_S + HEALTH_READ_TIMEOUT_S)
ROOM_TIMEOUT_S = 8.0
SETTLE_S = 30.0
PROBE_DEADLINE_S = 25.0
QUIESCE_S = 15.0
ROTATE_QUARANTINE_PERCENT = 1.0
"""The decodes fence by engine rotation (docs/operations.md) once pages held for dead writers
pass this share of a rank's pool or ring: Mooncake TCP has no per-peer receiver fence, so
without it a killed prefill's pages and staging regions stay held for good."""
PREFILLS = ("prefill-0", "prefill-1")
DECODES = ("decode-0", "decode-1")
EMBEDDED_REGISTRY = "prefill-0"
"""prefill-0 serves its own registry (as SGLang does); prefill-1 registers with the standalone
registry process on the ``registry`` host, the one the ``registry`` fault restarts."""


class ChaosOptions(msgspec.Struct, frozen=True):
    seed: int = 1
    duration_s: float = 60.0
    nemesis: tuple[str, ...] = KINDS
    out_dir: str = "out/chaos"
    rate_per_s: float = 3.0
    namespaces: bool = True
    aborts: tuple[str, ...] = ABORT_SIDES
    num_pages: int = 1024


class ReplayResult(msgspec.Struct):
    process: str
    life: int
    files: list[str]
    returncode: int
    output: str


class RunRecord(msgspec.Struct, kw_only=True):
    """Everything the checker and the report read."""

    options: ChaosOptions
    network: str
    addresses: dict[str, str]
    unavailable: dict[str, str]
    fault_means: dict[str, str]
    plan: list[PlannedRequest]
    faults: list[Applied]
    attempts: list[Attempt]
    shed: list[int]
    events: list[dict[str, Any]]
    lives: dict[str, list[dict[str, Any]]]
    final_state: dict[str, dict[str, Any]]
    replays: list[ReplayResult]
    workload_end: float
    wall_s: float
    mutant: str = ""
    wall0: float = 0.0
    """The wall-clock time (``time.time()``) of the run's t=0, to place wall times on it."""
    environment: dict[str, str] = msgspec.field(default_factory=dict)
    """The ``PDFLOW_*`` variables the agents inherited (pdflow's settings, the mutant): part of
    what reproduces the run. Values of names that look secret are not kept."""


SECRET_HINTS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
REDACTED = "<redacted>"


def pdflow_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``PDFLOW_*`` variables in ``environ`` (the process's by default), secrets redacted."""
    env = os.environ if environ is None else environ
    return {name: REDACTED if any(h in name.upper() for h in SECRET_HINTS) else value
            for name, value in sorted(env.items()) if name.startswith("PDFLOW_")}  # fmt: skip


def plan_schedule(options: ChaosOptions) -> list[Fault]:
    """The fault schedule of a run: drawn over the kinds asked for, not over what the network
    can do, so one seed gives one schedule on namespaces and on loopback (a fault the network
    cannot inject is skipped when it comes up)."""
    return plan_faults(options.seed, options.duration_s, options.nemesis, PREFILLS, DECODES,
                       DEAD_AFTER_S)  # fmt: skip


class RunClock:
    """One time origin for the whole history: the moment the workload and nemesis start."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> float:
        self.t0, self.wall0 = time.monotonic(), time.time()
        return self.t0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def since_wall(self, wall: float) -> float:
        return wall - self.wall0


def agent_settings(out: Path, name: str, address: str, life: int) -> dict[str, Any]:
    return {
        "host": address, "trace_dir": str(out / "traces" / f"{name}-life{life}"),
        "checksum": True, "heartbeat_interval": HEARTBEAT_S,
        "heartbeat_max_failure": HEARTBEAT_FAILURES, "bootstrap_timeout": ROOM_TIMEOUT_S,
        "waiting_timeout": ROOM_TIMEOUT_S, "trace_enabled": True,
    }  # fmt: skip


class Cluster:
    """The agents of one run and how to reach their registries."""

    def __init__(self, options: ChaosOptions, network: Network, out: Path,
                 on_event: Callable[[Agent, dict[str, Any]], None]) -> None:  # fmt: skip
        self.network = network
        self.seed = options.seed
        addresses = network.addresses
        registry_address = f"{addresses['registry']}:{BOOTSTRAP_PORT}"
        self.bootstraps = {
            name: (f"{addresses[name]}:{BOOTSTRAP_PORT}" if name == EMBEDDED_REGISTRY
                   else registry_address)
            for name in PREFILLS
        }  # fmt: skip

        def prefill_options(name: str) -> Callable[[int], dict[str, Any]]:
            return lambda life: {
                "settings": agent_settings(out, name, addresses[name], life), "tp": 2,
                "num_pages": options.num_pages, "bootstrap": self.bootstraps[name],
                "serve_bootstrap": name == EMBEDDED_REGISTRY,
            }  # fmt: skip

        def decode_options(name: str, index: int) -> Callable[[int], dict[str, Any]]:
            # decode-0 is TP=2 like the prefills; decode-1 is TP=1, so it receives staged.
            return lambda life: {
                "settings": {**agent_settings(out, name, addresses[name], life),
                             "rotate_quarantine_percent": ROTATE_QUARANTINE_PERCENT},
                "tp": 2 if index == 0 else 1, "staging": index != 0,
                "num_pages": options.num_pages, "seed": options.seed * 10 + index,
            }  # fmt: skip

        self.registry = Agent("registry", "registry", "registry", network, out,
                              lambda life: {"port": BOOTSTRAP_PORT}, on_event)  # fmt: skip
        self.prefills = [Agent(n, "prefill", n, network, out, prefill_options(n), on_event)
                         for n in PREFILLS]  # fmt: skip
        self.decodes = [Agent(n, "decode", n, network, out, decode_options(n, i), on_event)
                        for i, n in enumerate(DECODES)]  # fmt: skip

    @property
    def agents(self) -> list[Agent]:
        return [self.registry, *self.prefills, *self.decodes]

    def by_name(self, name: str) -> Agent:
        return next(a for a in self.agents if a.name == name)


def hosts() -> list[str]:
    return ["registry", *PREFILLS, *DECODES]


async def run_chaos(options: ChaosOptions, say: Callable[[str], None]) -> RunRecord:
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    network = open_network(hosts(), options.namespaces)
    skipped = [k for k in NETWORK_FAULTS if k in network.unavailable and k in options.nemesis]
    if network.kind != "netns":
        why = next(iter(network.unavailable.values()), "").split(": ", 1)[-1]
        say(f"running on loopback; faults {', '.join(network.unavailable)} cannot be injected "
            f"({why}); skipped where the schedule has them: {', '.join(skipped) or 'none'}")
    elif skipped:
        say("skipped where the schedule has them: "
            + "; ".join(network.unavailable[k] for k in skipped))
    cluster: Cluster | None = None
    try:
        events: list[dict[str, Any]] = []
        clock = RunClock()

        def on_event(agent: Agent, event: dict[str, Any]) -> None:
            if event.get("event") in ("canary", "violation", "error", "paused_mid_write"):
                # When the process saw it (its wall clock), not when this loop read it.
                seen = event.get("found_at")
                t = clock.since_wall(seen) if seen is not None else clock.now()
                events.append({**event, "process": agent.name, "life": agent.life,
                               "t": round(t, 3)})  # fmt: skip

        cluster = Cluster(options, network, out, on_event)
        return await _run(options, network, cluster, clock, events, out, say)
    finally:
        if cluster is not None:
            await _stop_all(cluster)
        for pid in network.processes_inside():
            kill_pid(pid)
        try:
            network.heal()
        except NetworkError as exc:  # deleting the namespaces below undoes it anyway
            log.warning("chaos_heal_failed_at_teardown", error=str(exc))
        finally:
            network.close()


async def _run(options: ChaosOptions, network: Network, cluster: Cluster, clock: RunClock,
               events: list[dict[str, Any]], out: Path,
               say: Callable[[str], None]) -> RunRecord:  # fmt: skip
    from pdflow.chaos.checker import settled

    started = time.monotonic()
    schedule = plan_schedule(options)
    plan = plan_workload(options.seed, options.duration_s, len(PREFILLS), len(DECODES),
                         options.rate_per_s, abort_sides=options.aborts)  # fmt: skip
    (out / "schedule.json").write_bytes(msgspec.json.encode(
        {"seed": options.seed, "faults": schedule, "requests": plan}))  # fmt: skip
    say(f"schedule written first: {len(schedule)} faults, {len(plan)} requests -> "
        f"{out / 'schedule.json'}")
    async with anyio.create_task_group() as tasks:
        say(f"starting {len(cluster.agents)} processes on {network.kind} "
            f"({', '.join(f'{h}={a}' for h, a in network.addresses.items())})")
        await cluster.registry.start(tasks)
        await cluster.prefills[0].start(tasks)
        async with anyio.create_task_group() as starting:
            for agent in [*cluster.prefills[1:], *cluster.decodes]:
                starting.start_soon(agent.start, tasks)
        t0 = clock.start()
        router = Router(plan, cluster.prefills, cluster.decodes, cluster.bootstraps, t0)

        async def kill(name: str) -> bool:
            return await cluster.by_name(name).kill(by="nemesis")

        async def restart(name: str) -> None:
            agent = cluster.by_name(name)
            if not agent.running:
                await agent.start(tasks)

        def send_signal(name: str, signum: signal.Signals) -> bool:
            return cluster.by_name(name).signal(signum)

        async def pause_at_write(prefill: str, decode: str, within_s: float) -> bool:
            return await cluster.by_name(prefill).pause_at_write(network.addresses[decode],
                                                                 within_s)  # fmt: skip

        nemesis = Nemesis(schedule, network, kill, restart, send_signal, pause_at_write, t0)
        say(f"running workload and nemesis for {options.duration_s:.0f}s")
        async with anyio.create_task_group() as running:
            running.start_soon(router.run, tasks)
            running.start_soon(nemesis.run)
        workload_end = router.now()
        try:
            await _heal(cluster, network, tasks, say)
        except NetworkError as exc:
            say(f"the heal left faults in place: {exc}")
            events.append({"event": "violation", "kind": "fault_heal_failed",
                           "process": "network", "t": round(clock.now(), 3),
                           "error": str(exc)})  # fmt: skip
        say("healed; settling")
        with anyio.move_on_after(SETTLE_S):
            while router.in_flight:
                await anyio.sleep(0.2)
        await _probe_pairs(router, cluster)
        say("probed every prefill x decode pair; collecting end state")
        final_state = await _quiesce(cluster, settled)
        await _stop_all(cluster)
        tasks.cancel_scope.cancel()
    replays = _replay_all(cluster, say)
    return RunRecord(
        options=options, network=network.kind, addresses=dict(network.addresses),
        unavailable=dict(network.unavailable), fault_means=FAULT_MEANS, plan=plan,
        faults=nemesis.applied, attempts=router.attempts, shed=router.shed, events=events,
        lives={a.name: a.lives for a in cluster.agents}, final_state=final_state,
        replays=replays, workload_end=workload_end, wall_s=time.monotonic() - started,
        mutant=os.environ.get(MUTANT_VARIABLE, ""), wall0=clock.wall0,
        environment=pdflow_environment(),
    )  # fmt: skip


async def _heal(cluster: Cluster, network: Network, tasks: anyio.abc.TaskGroup,
                say: Callable[[str], None]) -> None:  # fmt: skip
    try:
        network.heal()
    finally:  # the processes are resumed and restarted whatever the network said
        await _restart_all(cluster, tasks, say)


async def _restart_all(cluster: Cluster, tasks: anyio.abc.TaskGroup,
                       say: Callable[[str], None]) -> None:  # fmt: skip
    for agent in cluster.agents:
        agent.signal(signal.SIGCONT)
        if not agent.running:
            # The nemesis restarts what it kills: a process down here died on its own (the
            # checker reports it as process_died) or its restart failed (fault_heal_failed).
            ended = agent.lives[-1] if agent.lives else {}
            why = ("its restart after the nemesis's kill failed"
                   if ended.get("ended_by") == "nemesis" else
                   f"it ended on its own, rc {ended.get('returncode')}")  # fmt: skip
            say(f"{agent.name} life {ended.get('life')} was not running at the heal ({why}); "
                "starting it again for the probes")
            await agent.start(tasks)


async def _probe_pairs(router: Router, cluster: Cluster) -> None:
    """After healing: every prefill x decode pair must serve a fresh room again, with the same
    decode processes (none is ever restarted)."""
    probe_base = 2**50 + 100 * cluster.seed

    async def pair(p: int, d: int) -> None:
        deadline = router.now() + PROBE_DEADLINE_S
        request = PlannedRequest(index=-1, at=router.now(), tokens=64, prefill=p, decode=d,
                                 chunk_pages=2)  # fmt: skip
        tries = 0
        while router.now() < deadline:
            room = probe_base + 1000 * tries + 10 * p + d  # a fresh id for every try
            tries += 1
            record = await router.attempt(room, request, p, None, probe=True)
            if record.outcome == "success":
                return
            await anyio.sleep(1.0)

    async with anyio.create_task_group() as probes:
        for p in range(len(cluster.prefills)):
            for d in range(len(cluster.decodes)):
                probes.start_soon(pair, p, d)


NodeState = dict[str, Any]


async def _quiesce(cluster: Cluster,
                   settled: Callable[[NodeState], bool]) -> dict[str, NodeState]:  # fmt: skip
    """Each node's end state, polled until every node is quiet (or the time is up)."""
    states: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + QUIESCE_S
    while True:
        for agent in [*cluster.prefills, *cluster.decodes]:
            states[agent.name] = await agent.state()
        if all(settled(s) for s in states.values()) or time.monotonic() > deadline:
            return states
        await anyio.sleep(0.5)


async def _stop_all(cluster: Cluster) -> None:
    with anyio.CancelScope(shield=True):
        for agent in cluster.agents:
            await agent.quit()


def _replay_all(cluster: Cluster, say: Callable[[str], None]) -> list[ReplayResult]:
    """`pdflow replay` on each process life's traces (a killed life's traces included)."""
    results = []
    for agent in [*cluster.prefills, *cluster.decodes]:
        for life, files in trace_files(agent).items():
            done = subprocess.run(
                [sys.executable, "-m", "pdflow.cli", "replay", *map(str, files)],
                capture_output=True, text=True, timeout=300,
            )
            output = (done.stdout + done.stderr)[-2000:]
            results.append(ReplayResult(agent.name, life, [str(f) for f in files],
                                        done.returncode, output))  # fmt: skip
    say(f"replayed {len(results)} process lives' traces")
    return results
