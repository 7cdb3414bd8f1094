"""Driver processes for the SGLang backend tests: spawn, read their events, command, kill."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pdflow.sglang.identity import INCARNATION_ENV, STARTED_AT_ENV

DRIVER = Path(__file__).resolve().parent / "driver.py"




def _inherited_env() -> dict[str, str]:
    """This environment without the SGLang instance identity: each driver process is its own
    instance (a new incarnation) unless the caller passes one. A test that ran the adapter in
    the pytest process set it here, and every later driver inherited it, so a restarted prefill
    came back as the incarnation the decode had seen replaced."""
    return {k: v for k, v in os.environ.items() if k not in (INCARNATION_ENV, STARTED_AT_ENV)}


class DriverProcess:
    """One ``driver.py`` process; its ``DRIVER`` events are collected as they come."""

    def __init__(self, role: str, *args: str, env: dict[str, str] | None = None,
                 log_dir: Path, python: str = sys.executable) -> None:  # fmt: skip
        self.role = role
        self.events: list[dict[str, Any]] = []
        self._inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [python, str(DRIVER), role, *args, "--events-fd", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True,
            env={**_inherited_env(), **(env or {})}, pass_fds=(write_fd,),
        )  # fmt: skip
        os.close(write_fd)
        self._event_pipe = os.fdopen(read_fd)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._event_pipe:
            event = json.loads(line)
            event["received_at"] = time.monotonic()  # for latencies measured by the caller
            self.events.append(event)
            self._inbox.put(event)

    def wait_for(self, kind: str, timeout: float, **match: Any) -> dict[str, Any]:
        """The first event of ``kind`` (matching ``match``) from now or already seen."""
        for event in self.events:
            if event["event"] == kind and all(event.get(k) == v for k, v in match.items()):
                return event
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and self._inbox.empty()):
                raise AssertionError(
                    f"{self.role}: no {kind} {match or ''} within {timeout} s "
                    f"(exit {self.proc.poll()}); log {self.log_path}"
                )
            try:
                event = self._inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if event["event"] == kind and all(event.get(k) == v for k, v in match.items()):
                return event

    def seen(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events
                if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]  # fmt: skip

    def command(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def report(self, timeout: float = 10.0) -> dict[str, Any]:
        before = len(self.seen("report"))
        self.command(cmd="report")
        deadline = time.monotonic() + timeout
        while len(self.seen("report")) == before:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role}: no report; log {self.log_path}")
            time.sleep(0.05)
        return self.seen("report")[-1]

    def signal(self, number: int) -> None:
        os.kill(self.proc.pid, number)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


def run_batch(prefills: list[DriverProcess], decode: DriverProcess, *, rooms: int, base: int,
              bootstrap_port: int) -> dict[str, Any]:  # fmt: skip
    """Once every prefill and the decode are ready, the decode runs one batch of ``rooms``
    rooms from ``base``; returns its ``batch_done`` event."""
    for process in [*prefills, decode]:
        process.wait_for("prefill_ready" if process in prefills else "decode_ready",
                         timeout=240)  # fmt: skip
    decode.command(cmd="batch", count=rooms, base=base, bootstrap_port=bootstrap_port)
    return decode.wait_for("batch_done", timeout=180, base=base)
