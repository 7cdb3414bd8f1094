"""The floor of one control message between two nodes' event loops: a StatusReport from one
``ControlChannel`` to another on loopback (the nodes' own sockets, codec and receive loop),
timed from the sender's ``send`` to the receiver's deliver.

Both channels run on one event loop, as both nodes do in `pdflow_vs_raw` and `room_timeline`;
each message is sent alone after an idle pause (``--gap-ms``), as a room's StatusReport is,
so it pays libzmq's wake of its I/O thread and the loop's wake on the socket each time. The
result is the median (and p10/p90) one-way time in microseconds, and the same for a round
trip (ping, pong) halved.

    python -m benchmarks.control_floor --messages 400
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import zmq.asyncio

from benchmarks.common import latency_summary
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import PeerId, StatusReport
from pdflow.io.codec import ControlMessage, MsgpackCodec
from pdflow.io.control import ControlChannel

PEER = PeerId("127.0.0.1:1", "x", 0)


async def _measure(messages: int, gap_s: float) -> dict[str, Any]:
    context = zmq.asyncio.Context()
    codec = MsgpackCodec()
    a, b = ControlChannel.open(context, codec), ControlChannel.open(context, codec)
    arrived: list[float] = []
    got = anyio.Event()
    echo = False

    async def at_b(message: ControlMessage, msg_id: str | None) -> None:
        nonlocal got
        arrived.append(time.perf_counter())
        if echo:
            await b.send(a.address, message, msg_id)
        else:
            got.set()

    async def at_a(message: ControlMessage, msg_id: str | None) -> None:
        arrived.append(time.perf_counter())
        got.set()

    one_way: list[float] = []
    rounds: list[float] = []
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(a.receive_forever, at_a)
            tasks.start_soon(b.receive_forever, at_b)
            for index in range(messages + 20):  # the first 20 warm the connections up
                echo = index % 2 == 1
                report = StatusReport(index, 0, KVPoll.Success, PEER, PEER)
                got, arrived = anyio.Event(), []
                await anyio.sleep(gap_s)
                started = time.perf_counter()
                await a.send(b.address, report, f"m{index}")
                with anyio.fail_after(5):
                    await got.wait()
                if index < 20:
                    continue
                if echo:
                    rounds.append((arrived[-1] - started) / 2)
                else:
                    one_way.append(arrived[0] - started)
            tasks.cancel_scope.cancel()
    finally:
        a.close()
        b.close()
        context.destroy(linger=0)

    return {"benchmark": "control_floor", "messages": messages, "gap_ms": gap_s * 1e3,
            "one_way": latency_summary(one_way),
            "round_trip_half": latency_summary(rounds)}  # fmt: skip


def run(messages: int = 400, gap_s: float = 0.002) -> dict[str, Any]:
    result: dict[str, Any] = anyio.run(_measure, messages, gap_s, backend="asyncio")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    result = run(args.messages, args.gap_ms / 1e3)
    for part in ("one_way", "round_trip_half"):
        figures = result[part]
        print(f"{part:16} median {figures['median_us']:6.1f} us  p10 {figures['p10_us']:6.1f}"
              f"  p90 {figures['p90_us']:6.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
