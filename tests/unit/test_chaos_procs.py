"""The chaos harness's process lives, on small real processes standing in for the agents: who
ended a life, what becomes of the answers still awaited, a second answer for one room."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from pdflow.chaos.checker import check
from pdflow.chaos.netns import LoopbackNetwork
from pdflow.chaos.procs import Agent, Pending
from pdflow.chaos.run import ChaosOptions, RunRecord

READY = ('import json, os, sys; '
         'print(json.dumps({"event": "ready", "incarnation": "i1"}), flush=True)')
CRASH_ON_FIRST_COMMAND = READY + "\nsys.stdin.readline(); os._exit(3)"
NEVER_ANSWERS = READY + "\nfor line in sys.stdin: pass\nimport time; time.sleep(60)"


class ScriptAgent(Agent):
    """An agent whose process is a short Python script instead of a node."""

    def __init__(self, out: Path, script: str, events: list[dict[str, Any]]) -> None:
        super().__init__("prefill-1", "prefill", "prefill-1",
                         LoopbackNetwork(["prefill-1"], "test"), out, lambda life: {},
                         lambda agent, event: events.append(event))  # fmt: skip
        self.script = script

    def argv(self) -> list[str]:
        return [sys.executable, "-c", self.script]


def run_agent(tmp_path: Path, script: str, body: Any) -> tuple[ScriptAgent, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    agent = ScriptAgent(tmp_path, script, events)

    async def main() -> None:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                await agent.start(tasks)
                await body(agent)
                tasks.cancel_scope.cancel()

    anyio.run(main)
    return agent, events


def record(lives: dict[str, Any]) -> RunRecord:
    return RunRecord(
        options=ChaosOptions(), network="netns", addresses={}, unavailable={}, fault_means={},
        plan=[], faults=[], attempts=[], shed=[], events=[], lives=lives, final_state={},
        replays=[], workload_end=10.0, wall_s=20.0,
    )  # fmt: skip


def test_a_process_that_dies_on_its_own_is_process_died_and_its_rooms_killed(
    tmp_path: Path,
) -> None:
    answers = {}

    async def body(agent: Agent) -> None:
        waiter = await agent.run_room({"room": 5, "generation": 0})
        await waiter.done.wait()
        answers["room"] = waiter.value
        await agent.exited.wait()

    agent, _ = run_agent(tmp_path, CRASH_ON_FIRST_COMMAND, body)
    assert answers["room"]["results"] == ["Killed"]
    (life,) = agent.lives
    assert life["lost"] and life["ended_by"] is None and life["returncode"] == 3
    (died,) = check(record({"prefill-1": agent.lives}))
    assert died.kind == "process_died" and died.process == "prefill-1"
    assert "rc 3" in died.detail and "prefill-1-life1.log" in died.detail


def test_a_life_the_nemesis_killed_is_excused(tmp_path: Path) -> None:
    async def body(agent: Agent) -> None:
        assert await agent.kill(by="nemesis")
        assert not await agent.kill(by="nemesis")  # nothing running: nothing killed
        assert not agent.signal(signal.SIGSTOP)  # nor signalled

    agent, _ = run_agent(tmp_path, NEVER_ANSWERS, body)
    (life,) = agent.lives
    assert life["lost"] and life["ended_by"] == "nemesis"
    assert check(record({"prefill-1": agent.lives})) == []


def test_rooms_still_awaited_when_the_harness_stops_a_process_are_not_terminal(
    tmp_path: Path,
) -> None:
    answers = {}

    async def body(agent: Agent) -> None:
        waiter = await agent.run_room({"room": 5, "generation": 0})
        await agent.quit(timeout_s=0.2)  # it ignores the quit: killed after the timeout
        answers["room"] = waiter.value

    agent, _ = run_agent(tmp_path, NEVER_ANSWERS, body)
    assert answers["room"]["results"] == []  # not "Killed": nothing killed it mid-run
    assert "stopped at the end of the run" in answers["room"]["reasons"][0]
    (life,) = agent.lives
    assert not life["lost"] and life["ended_by"] == "harness"
    assert check(record({"prefill-1": agent.lives})) == []


@pytest.mark.parametrize("second", [["Failed", "Failed"], ["Success", "Success"]])
def test_a_second_different_answer_for_one_room_is_a_violation(
    tmp_path: Path, second: list[str],
) -> None:
    events: list[dict[str, Any]] = []
    agent = ScriptAgent(tmp_path, NEVER_ANSWERS, events)
    agent.pending[(6, 0)] = waiter = Pending()
    agent._dispatch({"event": "room", "room": 6, "generation": 0,
                     "results": ["Success", "Success"], "reasons": ["", ""]})  # fmt: skip
    agent._dispatch({"event": "room", "room": 6, "generation": 0, "results": second,
                     "reasons": ["late", "late"]})  # fmt: skip
    assert waiter.value["results"] == ["Success", "Success"]
    flagged = [e for e in events if e["event"] == "violation"]
    if second == ["Success", "Success"]:
        assert flagged == []  # the same answer twice changes nothing
    else:
        (event,) = flagged
        assert event["kind"] == "conflicting_room_result" and event["room"] == 6
        assert event["first"] == ["Success", "Success"] and event["second"] == second
