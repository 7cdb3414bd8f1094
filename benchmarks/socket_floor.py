"""The floor of telling another process anything on loopback: one 60-byte message one way over
bare pyzmq PUSH/PULL and over a plain TCP socket, with no asyncio, codec or pdflow code at all.

Why it exists: a room is done for the decode only once the decode hears so, and the raw
engine baseline of `pdflow_vs_raw` tells nobody. At 0.9x of a raw 1 MiB write of ``raw_ms``
the whole of pdflow's extra time may be ``raw_ms * (1 / 0.9 - 1)`` (0.4-0.5 ms here: about
45-55 us), and this measures what one notification costs by itself on this machine. Each
message is sent after an idle gap, as a room's status message is:

* ``sleep``: the sender sleeps ``gap_ms`` first (the CPU may go idle; the common case);
* ``spin``: the sender busy-waits ``gap_ms`` (the vCPU stays awake);
* ``none``: back to back.

Kinds: ``zmq`` (PUSH/PULL, blocking recv in the same thread: libzmq's two I/O threads carry
it), ``tcp`` (TCP_NODELAY, same thread: the kernel's loopback path only) and ``tcp_thread``
(the receiver is another thread blocked in ``recv``, as a node's loop is in ``epoll``: adds
that thread's wake-up). Medians, p10 and p90 in microseconds.

    python -m benchmarks.socket_floor --messages 300 --raw-ms 0.45
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing, contextmanager
from typing import Any

import zmq

from benchmarks.common import latency_summary
from pdflow.bench.runner import DATA_RATIO_TARGET

PAYLOAD = b"x" * 60
WARM_UP = 20
IDLES = ("sleep", "spin", "none")

# One send-and-wait: returns the seconds from just before the send to the message's arrival.
OneWay = Callable[[], float]


def _idle(kind: str, gap_s: float) -> None:
    if kind == "sleep":
        time.sleep(gap_s)
    elif kind == "spin":
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass


@contextmanager
def _zmq_pair() -> Iterator[OneWay]:
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")

        def one_way() -> float:
            started = time.perf_counter()
            push.send(PAYLOAD)
            pull.recv()
            return time.perf_counter() - started

        yield one_way
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


@contextmanager
def _tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with closing(socket.socket()) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sender = socket.create_connection(listener.getsockname())
        receiver, _ = listener.accept()
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with closing(sender), closing(receiver):
        yield sender, receiver


@contextmanager
def _tcp_same_thread() -> Iterator[OneWay]:
    with _tcp_pair() as (sender, receiver):

        def one_way() -> float:
            started = time.perf_counter()
            sender.sendall(PAYLOAD)
            got = 0
            while got < len(PAYLOAD):
                got += len(receiver.recv(len(PAYLOAD) - got))
            return time.perf_counter() - started

        yield one_way


@contextmanager
def _tcp_other_thread() -> Iterator[OneWay]:
    with _tcp_pair() as (sender, receiver):
        arrived = threading.Event()
        at: list[float] = [0.0]

        def receive() -> None:
            got = 0
            while data := receiver.recv(4096):
                got += len(data)
                if got >= len(PAYLOAD):
                    got -= len(PAYLOAD)
                    at[0] = time.perf_counter()
                    arrived.set()

        reader = threading.Thread(target=receive, name="socket-floor-reader", daemon=True)
        reader.start()

        def one_way() -> float:
            arrived.clear()
            started = time.perf_counter()
            sender.sendall(PAYLOAD)
            if not arrived.wait(5):
                raise RuntimeError("a 60-byte message on loopback took over 5 s")
            return at[0] - started

        try:
            yield one_way
        finally:
            sender.shutdown(socket.SHUT_WR)  # the reader sees end of stream and returns
            reader.join(5)


_PAIRS: dict[str, Callable[[], AbstractContextManager[OneWay]]] = {
    "zmq": _zmq_pair, "tcp": _tcp_same_thread, "tcp_thread": _tcp_other_thread,
}  # fmt: skip
KINDS = tuple(_PAIRS)


def measure(kind: str, idle: str, messages: int, gap_s: float) -> dict[str, float]:
    """One kind after one idle mode: the latency summary of ``messages`` sends."""
    if kind not in _PAIRS:
        raise ValueError(f"unknown kind {kind!r}: choose from {', '.join(KINDS)}")
    if idle not in IDLES:
        raise ValueError(f"unknown idle mode {idle!r}: choose from {', '.join(IDLES)}")
    if messages < 1:
        raise ValueError(f"messages must be at least 1, got {messages}")
    times: list[float] = []
    with _PAIRS[kind]() as one_way:
        for index in range(messages + WARM_UP):
            _idle(idle, gap_s)
            seconds = one_way()
            if index >= WARM_UP:
                times.append(seconds)
    return latency_summary(times)


def run(
    messages: int = 300,
    gap_s: float = 0.002,
    raw_ms: float | None = None,
    kinds: tuple[str, ...] = KINDS,
    idles: tuple[str, ...] = IDLES,
) -> dict[str, Any]:
    floors = {f"{kind}/{idle}": measure(kind, idle, messages, gap_s)
              for kind in kinds for idle in idles}  # fmt: skip
    result: dict[str, Any] = {"benchmark": "socket_floor", "messages": messages,
                              "gap_ms": gap_s * 1e3, "floors": floors}  # fmt: skip
    if raw_ms is not None:
        allowance_us = raw_ms * 1e3 * (1 / DATA_RATIO_TARGET - 1)
        result["raw_ms"] = raw_ms
        result["allowance_us"] = allowance_us
        result["within_allowance"] = {
            name: figures["median_us"] <= allowance_us for name, figures in floors.items()
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument(
        "--raw-ms", type=float,
        help="the raw engine's time for the room (ms): also print what 0.9x of it leaves for "
        "everything else, the notification included",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args()
    result = run(args.messages, args.gap_ms / 1e3, args.raw_ms)
    for name, figures in result["floors"].items():
        print(f"{name:18} median {figures['median_us']:7.1f} us  p10 {figures['p10_us']:7.1f}"
              f"  p90 {figures['p90_us']:7.1f}")  # fmt: skip
    if args.raw_ms is not None:
        print(f"0.9x of a {args.raw_ms} ms raw write leaves {result['allowance_us']:.1f} us "
              "for all of pdflow's extra time")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
