"""The processes of a chaos run: one agent per host, each a separate OS process started inside
its host's namespace, driven over its stdin and read on its stdout (never over the network).

Each start is a new *life* (a new incarnation for a node); its trace directory, log file and
pending results belong to that life. When a life ends during the run (kill -9 or a crash) every
result still awaited from it resolves as ``Killed``, so the router never waits for a dead
process; when the harness stops it at the end, they resolve as not terminal (no result: the
room never ended). Each life records who ended it (``ended_by``: ``nemesis`` for a planned
kill, ``harness`` at the end, None for a life that ended on its own), so the checker excuses
only the deaths the nemesis caused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import Process, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream

from pdflow.chaos.netns import Network

log = structlog.get_logger("pdflow.chaos.procs")

START_TIMEOUT_S = 90.0
"""Generous: a start imports torch-free pdflow and Mooncake on two busy cores."""

OnEvent = Callable[["Agent", dict[str, Any]], None]

STARTED: set[int] = set()
"""Every pid this process started, for the last-resort cleanup (see :func:`kill_started`)."""


def kill_started() -> None:
    for pid in sorted(STARTED):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    STARTED.clear()


class StartFailed(RuntimeError):
    """A process exited or hung before it said it was ready."""


class Pending:
    """A result a process will print (or fail to, if its life ends first)."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: dict[str, Any] = {}

    def set(self, value: dict[str, Any]) -> None:
        if not self.done.is_set():
            self.value = value
            self.done.set()


class Agent:
    """One host's process, across its lives."""

    def __init__(self, name: str, role: str, host: str, network: Network, out_dir: Path,
                 options: Callable[[int], dict[str, Any]], on_event: OnEvent) -> None:  # fmt: skip
        self.name, self.role, self.host = name, role, host
        self.network = network
        self.out_dir = out_dir
        self.options = options
        self.on_event = on_event
        self.life = 0
        self.process: Process | None = None
        self.ready: dict[str, Any] = {}
        self.pending: dict[tuple[int, int], Pending] = {}
        self.state_reply: Pending | None = None
        self.write_pause: tuple[int, Pending] | None = None  # (arming id, its outcome)
        self.armings = 0
        self.lives: list[dict[str, Any]] = []
        self.paused = False
        self.quitting = False
        self.ended_by: str | None = None
        self.exited = anyio.Event()
        # Each (room, generation)'s first answer, to tell a conflicting second one.
        self.answered: dict[tuple[int, int], list[str]] = {}

    @property
    def address(self) -> str:
        return self.network.addresses[self.host]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def trace_dir(self, life: int) -> Path:
        return self.out_dir / "traces" / f"{self.name}-life{life}"

    def argv(self) -> list[str]:
        module = {"prefill": "pdflow.chaos.prefill_agent", "decode": "pdflow.chaos.decode_agent",
                  "registry": "pdflow.cli"}[self.role]  # fmt: skip
        if self.role == "registry":
            args = ["bootstrap", "--host", self.address, "--port", str(self.options(self.life)
                                                                        ["port"])]  # fmt: skip
        else:
            args = [json.dumps(self.options(self.life))]
        return [*self.network.command_prefix(self.host), sys.executable, "-m", module, *args]

    async def start(self, tasks: TaskGroup) -> None:
        """Start the next life and wait until it says it is ready."""
        self.life += 1
        self.trace_dir(self.life).mkdir(parents=True, exist_ok=True)
        logs = self.out_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stderr = open(logs / f"{self.name}-life{self.life}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
        self.exited = anyio.Event()
        self.paused = self.quitting = False
        self.ended_by = None
        try:
            self.process = await anyio.open_process(self.argv(), env=env, stderr=stderr)
            STARTED.add(self.process.pid)
        finally:
            stderr.close()
        reader = BufferedByteReceiveStream(self.process.stdout)  # type: ignore[arg-type]
        try:
            with anyio.fail_after(START_TIMEOUT_S):
                line = await reader.receive_until(b"\n", 1 << 20)
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
            self.process.kill()
            log_file = logs / f"{self.name}-life{self.life}.log"
            tail = log_file.read_text(errors="replace")[-1500:]
            raise StartFailed(f"{self.name} (life {self.life}) did not become ready "
                              f"({type(exc).__name__}); the end of {log_file}:\n{tail}") from None
        self.ready = (
            {"event": "ready", "text": line.decode()} if self.role == "registry"
            else json.loads(line)
        )  # fmt: skip
        self.lives.append({"life": self.life, "pid": self.process.pid, "started": time.time(),
                           "incarnation": self.ready.get("incarnation"),
                           "trace_dir": str(self.trace_dir(self.life))})  # fmt: skip
        log.info("chaos_process_ready", name=self.name, life=self.life, pid=self.process.pid)
        tasks.start_soon(self._pump, reader, self.process, self.life)

    async def _pump(self, reader: BufferedByteReceiveStream, process: Process, life: int) -> None:
        try:
            while True:
                try:
                    line = await reader.receive_until(b"\n", 1 << 22)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError,
                        anyio.BrokenResourceError):  # fmt: skip
                    break
                if self.role == "registry":
                    continue
                self._dispatch(json.loads(line))
            await process.wait()
        finally:
            if life == self.life:
                self._life_ended(process.returncode)

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "room" or (kind == "error" and event.get("room") is not None):
            if kind == "error":
                event = {**event, "results": ["Refused"], "reasons": [event["error"]]}
            self._answer(event)
        elif kind == "state" and self.state_reply is not None:
            self.state_reply.set(event)
        elif kind in ("paused_mid_write", "write_pause_disarmed"):
            if kind == "paused_mid_write":
                self.paused = True  # it stopped itself; the nemesis sends the SIGCONT
            if self.write_pause is not None and self.write_pause[0] == event.get("id"):
                self.write_pause[1].set(event)
        self.on_event(self, event)

    def _answer(self, event: dict[str, Any]) -> None:
        """A room's result: to its waiter; a second, different answer for the same room and
        generation is reported as a violation (the first one is what the router used)."""
        key = (event["room"], event["generation"])
        results = list(event.get("results", []))
        waiter = self.pending.pop(key, None)
        first = self.answered.setdefault(key, results)
        if waiter is not None:
            waiter.set(event)
        elif first != results:
            self.on_event(self, {
                "event": "violation", "kind": "conflicting_room_result", "room": key[0],
                "generation": key[1], "first": first, "second": results,
                "reasons": event.get("reasons", []),
            })  # fmt: skip

    def _life_ended(self, returncode: int | None) -> None:
        for waiter in self.pending.values():
            if self.quitting:  # stopped at the end of the run: the room never ended there
                waiter.set({"event": "room", "results": [], "life_ended": True,
                            "reasons": [f"{self.name} was stopped at the end of the run before "
                                        f"it answered for the room (life {self.life})"]})
            else:
                waiter.set({"event": "room", "results": ["Killed"], "life_ended": True,
                            "reasons": [f"{self.name} life {self.life} ended (rc {returncode})"]})
        self.pending.clear()
        if self.state_reply is not None:
            self.state_reply.set({"event": "state", "dead": True})
        if self.write_pause is not None:
            self.write_pause[1].set({"event": "write_pause_disarmed", "dead": True})
        if self.lives:
            self.lives[-1]["ended"] = time.time()
            self.lives[-1]["returncode"] = returncode
            # Killed or crashed, as opposed to stopped by the harness at the end of the run.
            self.lives[-1]["lost"] = not self.quitting
            self.lives[-1]["ended_by"] = self.ended_by or ("harness" if self.quitting else None)
        self.exited.set()

    async def send(self, command: dict[str, Any]) -> bool:
        if not self.running or self.process is None or self.process.stdin is None:
            return False
        try:
            await self.process.stdin.send((json.dumps(command) + "\n").encode())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def run_room(self, command: dict[str, Any]) -> Pending:
        """Send a room command; the returned result resolves when the process answers."""
        waiter = Pending()
        key = (command["room"], command["generation"])
        self.pending[key] = waiter
        if not await self.send({"op": "room", **command}):
            self.pending.pop(key, None)
            waiter.set({"event": "room", "results": ["NotRunning"],
                        "reasons": [f"{self.name} is not running"]})  # fmt: skip
        return waiter

    async def state(self, timeout_s: float = 10.0) -> dict[str, Any]:
        self.state_reply = Pending()
        if not await self.send({"op": "state"}):
            return {"event": "state", "dead": True}
        with anyio.move_on_after(timeout_s):
            await self.state_reply.done.wait()
        return self.state_reply.value or {"event": "state", "timeout": True}

    async def pause_at_write(self, peer_host: str, within_s: float) -> bool:
        """Arm this prefill to stop itself (SIGSTOP) inside its next write to ``peer_host``: True
        once it has, False if no such write began within ``within_s`` (it is then disarmed)."""
        self.armings += 1
        arming, outcome = self.armings, Pending()
        self.write_pause = (arming, outcome)
        if not await self.send({"op": "pause_at_write", "id": arming, "host": peer_host}):
            return False
        with anyio.move_on_after(within_s):
            await outcome.done.wait()
        if not outcome.done.is_set():
            # Disarm; a write that began before the disarm was read still stops it, and its
            # event comes first (one stdout, in order).
            await self.send({"op": "pause_at_write", "id": arming, "host": None})
            with anyio.move_on_after(10):
                await outcome.done.wait()
        return outcome.value.get("event") == "paused_mid_write"

    def signal(self, signum: signal.Signals) -> bool:
        """Send ``signum`` to the running life; False (nothing sent) when none is running."""
        if not self.running or self.process is None:
            return False
        try:
            self.process.send_signal(signum)
        except ProcessLookupError:
            return False
        if signum == signal.SIGSTOP:
            self.paused = True
        elif signum == signal.SIGCONT:
            self.paused = False
        return True

    async def kill(self, by: str = "harness") -> bool:
        """kill -9 and wait for the life to end; ``by`` is recorded as who ended it. False when
        no life was running."""
        if not self.running:
            return False
        self.ended_by = by
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with anyio.move_on_after(10):
            await self.exited.wait()
        return True

    async def quit(self, timeout_s: float = 20.0) -> None:
        """Ask the process to stop (traces flushed); kill it if it does not."""
        if not self.running or self.process is None:
            return
        self.quitting = True
        self.signal(signal.SIGCONT)
        if self.role == "registry":
            self.process.terminate()
        else:
            await self.send({"op": "quit"})
        with anyio.move_on_after(timeout_s):
            await self.exited.wait()
        await self.kill()


def trace_files(agent: Agent) -> dict[int, list[Path]]:
    """Each life's trace files."""
    found = {}
    for life in range(1, agent.life + 1):
        files = sorted(agent.trace_dir(life).glob("*.jsonl*"))
        if files:
            found[life] = files
    return found
