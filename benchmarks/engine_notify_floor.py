"""The floor of a completion word: the raw engine writes a room, then tells the decode through
the engine itself, with no socket, asyncio or pdflow code on the way.

Why it exists: `pdflow_vs_raw` holds pdflow's room (last `send_chunk` to the decode's Success)
to 0.9x of the raw engine's write, which tells nobody; `socket_floor` shows that any socket
message after an idle gap costs more than that allowance at 1 MiB. The route left would be a
completion word: after the room's KV the prefill writes one 8-byte op into memory the decode
polls. This measures that route at its very best, between two processes on loopback (a writer
that owns the source engine, a receiver child that owns the destination engine and spins on the
word with nothing else to do), each round one of:

* ``raw``: one ``batch_transfer_sync_write`` of the room's ops (what `pdflow_vs_raw` calls);
* ``word_after``: the same call, then a ``transfer_sync_write`` of the word once it returned
  (ops on different lanes complete out of order, so a correct word goes after the KV has
  landed); timed until the receiver sees the word;
* ``word_in_batch``: the word as one more op of the same batch call, timed the same way.

In both word modes the receiver checks, as it sees the word, that the last 8 bytes of every KV
op have landed; the rounds where they had not are counted (``*_seen_before_kv``). The word in
the batch is seen early in some rounds (the reason it cannot be used); the word after, never.
The receiver is armed and polling in every round, raw ones included (there it waits for every
op's last 8 bytes): a round right after one that found it idle ran 2-4 ms slower, whatever
its mode. It polls with ``sched_yield`` between reads: a bare spin kept its own engine's
threads off the core for milliseconds on two cores.

Rounds interleave the three; figures are medians, p10 and p90 in microseconds, and
``ratio`` is raw / word_after: the most any pdflow room with this notification could reach.

    python -m benchmarks.engine_notify_floor --size-kib 1024 --ops 4 --rounds 200
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import latency_summary, raw_engine, write_json
from pdflow.bench.runner import DATA_RATIO_TARGET

WORD = 8
MODES = ("raw", "word_after", "word_in_batch")


def _marks(base: int, size: int, ops: int) -> list[int]:
    # The last word of every op's span: an op's bytes stream in order, so it lands last.
    span = size // ops
    return [base + (index + 1) * span - WORD for index in range(ops)]


def receive(size: int, ops: int) -> None:
    """(The child) own the destination engine; for each round named on stdin, spin on the word
    and report when it changed and whether the KV was all there by then."""
    engine = raw_engine()
    memory = ctypes.create_string_buffer(size + WORD)
    base = ctypes.addressof(memory)
    if engine.register_memory(base, size + WORD) != 0:
        raise RuntimeError("the receiver could not register its buffer")
    word = ctypes.c_uint64.from_address(base + size)
    marks = [ctypes.c_uint64.from_address(addr) for addr in _marks(base, size, ops)]
    print(json.dumps({"peer": f"127.0.0.1:{engine.get_rpc_port()}", "base": base}), flush=True)
    for line in sys.stdin:
        number, watch = line.split()
        expected = int(number)
        print("armed", flush=True)
        # "word": wait for the word; "kv": wait for every op's last 8 bytes (a raw round, so
        # that every round finds the receiver polling alike).
        while not (word.value == expected if watch == "word"
                   else all(mark.value == expected for mark in marks)):  # fmt: skip
            # Give the core to this process's engine threads (they land the bytes): a bare
            # spin held them off for milliseconds on two cores.
            os.sched_yield()
        seen = time.perf_counter()
        complete = all(mark.value == expected for mark in marks)
        print(json.dumps({"round": expected, "seen": seen, "complete": complete}), flush=True)


class _Receiver:
    def __init__(self, size: int, ops: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.engine_notify_floor", "--receiver", str(size),
             "--ops", str(ops)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        hello = json.loads(self._line())
        self.peer, self.base = hello["peer"], int(hello["base"])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver exited (status {self.proc.poll()})")
        return line

    def arm(self, round_number: int, watch: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{round_number} {watch}\n")
        self.proc.stdin.flush()
        if self._line().strip() != "armed":
            raise RuntimeError("the receiver did not arm")

    def seen(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self._line())
        return report

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run(size: int = 1 << 20, ops: int = 4, rounds: int = 200,
        progress: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Measure the three modes; returns their latency summaries and the ratio."""
    if ops < 1 or size % ops or (size // ops) % WORD or rounds < 1:
        raise ValueError("need ops >= 1 dividing size into multiples of 8 bytes, rounds >= 1")
    receiver = _Receiver(size, ops)
    engine = raw_engine()
    source = ctypes.create_string_buffer(size + WORD)
    src = ctypes.addressof(source)
    try:
        if engine.register_memory(src, size + WORD) != 0:
            raise RuntimeError("the writer could not register its buffer")
        span = size // ops
        srcs = [src + index * span for index in range(ops)]
        dsts = [receiver.base + index * span for index in range(ops)]
        lengths = [span] * ops
        word_src, word_dst = src + size, receiver.base + size
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        early = {"word_after": 0, "word_in_batch": 0}

        def stamp(number: int) -> None:
            for addr in [*_marks(src, size, ops), word_src]:
                ctypes.c_uint64.from_address(addr).value = number

        def write(srcs_: list[int], dsts_: list[int], lengths_: list[int]) -> None:
            if engine.batch_transfer_sync_write(receiver.peer, srcs_, dsts_, lengths_):
                raise RuntimeError(f"a batch write of {len(lengths_)} ops failed")

        for number in range(1, 3 * rounds + 1):
            mode = MODES[number % len(MODES)]
            time.sleep(0.002)  # an idle gap before every room, as socket_floor leaves
            stamp(number)
            receiver.arm(number, "kv" if mode == "raw" else "word")
            started = time.perf_counter()
            if mode == "raw":
                write(srcs, dsts, lengths)
                seconds[mode].append(time.perf_counter() - started)
            elif mode == "word_after":
                write(srcs, dsts, lengths)
                if engine.transfer_sync_write(receiver.peer, word_src, word_dst, WORD):
                    raise RuntimeError("the word's write failed")
            else:
                write([*srcs, word_src], [*dsts, word_dst], [*lengths, WORD])
            report = receiver.seen()
            if report["round"] != number:
                raise RuntimeError(f"the receiver answered round {report['round']}, not {number}")
            if mode != "raw":  # raw is the writer's own time, as pdflow_vs_raw takes it
                seconds[mode].append(report["seen"] - started)
                early[mode] += not report["complete"]
    finally:
        receiver.close()
        engine.unregister_memory(src)
    result: dict[str, Any] = {
        "benchmark": "engine_notify_floor", "bytes": size, "ops": ops, "rounds": rounds,
        **{mode: latency_summary(values) for mode, values in seconds.items()},
        # After a batch call returned its bytes are in the receiver's memory, so word_after
        # must never be seen early; word_in_batch can be.
        **{f"{mode}_seen_before_kv": count for mode, count in early.items()},
    }  # fmt: skip
    result["ratio"] = result["raw"]["median_us"] / result["word_after"]["median_us"]
    progress(f"engine_notify_floor: {size // 1024} KiB in {ops} ops: raw "
             f"{result['raw']['median_us']:.0f} us, then a word "
             f"{result['word_after']['median_us']:.0f} us (ratio {result['ratio']:.2f} against "
             f"a {DATA_RATIO_TARGET}x target), word in the batch "
             f"{result['word_in_batch']['median_us']:.0f} us, seen before the KV in "
             f"{early['word_in_batch']} of {rounds} (after it: {early['word_after']})")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-kib", type=int, default=1024)
    parser.add_argument("--ops", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=200, help="rounds of each mode")
    parser.add_argument("--json", help="also write the result to this file")
    # The child run() starts: its buffer's size in bytes, exactly the writer's.
    parser.add_argument("--receiver", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver is not None:
        receive(args.receiver, args.ops)
        return
    result = run(args.size_kib * 1024, args.ops, args.rounds)
    if args.json:
        from pathlib import Path

        write_json(Path(args.json), result)


if __name__ == "__main__":
    main()
