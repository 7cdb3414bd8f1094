"""CPU per control message of the control channel: the receive loop
(``ControlChannel.receive_forever``) over a burst of queued frames, as the decode sees the
prefill's statuses queue up behind its engine calls, and over frames sent one at a time to a
waiting receiver; and ``ControlChannel.send`` while the peer's queue has room. Compare trees
side by side:
``PYTHONPATH=TREE/src python -m benchmarks.control_receive`` for each, alternating."""

from __future__ import annotations

import time

import anyio
import zmq
import zmq.asyncio

import pdflow
from pdflow.core.protocol.messages import Abort, PeerId
from pdflow.io.codec import ControlMessage, MsgpackCodec
from pdflow.io.control import ControlChannel

FRAMES = 20_000
PEER = PeerId("127.0.0.1:1", "x", 0)


def cpu_s() -> float:
    """CPU of this thread, the event loop's: not ZMQ's I/O thread, which holds no GIL."""
    return time.thread_time()


async def receive(frames: int, queued_first: bool) -> float:
    """CPU seconds the process spent receiving and delivering ``frames`` frames."""
    context = zmq.asyncio.Context()
    codec = MsgpackCodec()
    receiver = ControlChannel.open(context, codec)
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.connect(f"tcp://{receiver.address}")
    message = codec.encode(Abort(1, 0, PEER, PEER), None)
    handled = 0
    done = anyio.Event()
    got_one = anyio.Event()

    async def deliver(_: ControlMessage, __: str | None) -> None:
        nonlocal handled
        handled += 1
        got_one.set()
        if handled == frames:
            done.set()

    try:
        if queued_first:
            for _ in range(frames):
                await raw.send_multipart(message)
            # All sent: RECEIVE_HWM of them at the receiver, the rest in the sender's queue.
            await anyio.sleep(0.5)
        async with anyio.create_task_group() as tasks:
            started = cpu_s()
            tasks.start_soon(receiver.receive_forever, deliver)
            if not queued_first:
                for _ in range(frames):  # each sent once the last was handled
                    got_one = anyio.Event()
                    await raw.send_multipart(message)
                    await got_one.wait()
            await done.wait()
            spent = cpu_s() - started
            tasks.cancel_scope.cancel()
    finally:
        raw.close(linger=0)
        receiver.close()
        context.term()
    return spent


async def send(messages: int) -> float:
    """CPU seconds of ``messages`` sends to a peer whose queue always has room."""
    context = zmq.asyncio.Context()
    receiver = ControlChannel.open(context, MsgpackCodec())
    sender = ControlChannel.open(context, MsgpackCodec(), send_hwm=messages + 1)
    message = Abort(1, 0, PEER, PEER)
    try:
        await sender.send(receiver.address, message, None)  # the connection, not measured
        started = cpu_s()
        for _ in range(messages):
            await sender.send(receiver.address, message, None)
        return cpu_s() - started
    finally:
        sender.close()
        receiver.close()
        context.destroy(linger=0)


def main() -> None:
    tree = pdflow.__file__.rsplit("/src/", 1)[0]
    for name, queued_first in (("queued burst", True), ("one at a time", False)):
        best = min(anyio.run(receive, FRAMES, queued_first) for _ in range(3))
        print(f"{tree} {name}: {best / FRAMES * 1e6:.2f} us CPU per frame")
    best = min(anyio.run(send, FRAMES) for _ in range(3))
    print(f"{tree} send: {best / FRAMES * 1e6:.2f} us CPU per message")


if __name__ == "__main__":
    main()
