"""Cost of the control-plane MAC per frame: encode + decode with and without the cluster token.

For each message shape the script times ``frames`` round trips (sender encode, receiver
decode: what one control frame costs the two nodes together) through pdflow's plain
``MsgpackCodec`` and through ``AuthenticatedCodec`` around it, and reports microseconds per
frame for both, the MAC's added microseconds and the ratio. Shapes: a StatusReport (the most
frequent frame), a 4-page RoomMetadata (the load test's rooms) and a 64 Ki-page RoomMetadata
(about 300 KiB, where hashing the bytes dominates). The best of ``repeats`` runs is reported,
in CPU time of this process (so a machine shared with other work still gives usable figures).

    python -m benchmarks.control_mac --frames 20000 --json out/bench/control_mac.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_json
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import PeerId, RoomMetadata, StatusReport
from pdflow.io.codec import ControlMessage, MsgpackCodec, WireCodec
from pdflow.io.frame_auth import authenticated

DECODE = PeerId("10.0.0.2:41000", "0123456789abcdef", 0)
PREFILL = PeerId("10.0.0.1:40000", "fedcba9876543210", 3)


def _metadata(pages: int) -> RoomMetadata:
    return RoomMetadata(123456789, 0, DECODE, PREFILL, "10.0.0.2:16000",
                        tuple(range(100_000, 100_000 + pages)), None, 1)  # fmt: skip


SHAPES: dict[str, ControlMessage] = {
    "status_report": StatusReport(123456789, 0, KVPoll.Success, PREFILL, DECODE),
    "room_metadata_4_pages": _metadata(4),
    "room_metadata_64ki_pages": _metadata(1 << 16),
}


def _round_trips_us(sender: WireCodec, receiver: WireCodec, message: ControlMessage,
                    frames: int, repeats: int) -> float:  # fmt: skip
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for index in range(frames):
            receiver.decode(sender.encode(message, f"prefill-x#0:{index}:0"))
        best = min(best, time.process_time() - started)
    return best / frames * 1e6


def run(frames: int = 20_000, repeats: int = 5) -> dict[str, Any]:
    results: dict[str, Any] = {"frames": frames, "repeats": repeats, "shapes": {}}
    for name, message in SHAPES.items():
        count = frames if "64ki" not in name else max(frames // 100, 10)
        plain = MsgpackCodec()
        # Two wrappers with their own replay caches, as on two nodes.
        sender, receiver = (authenticated(MsgpackCodec(), "cluster-token", 30.0)
                            for _ in range(2))  # fmt: skip
        plain_us = _round_trips_us(plain, plain, message, count, repeats)
        mac_us = _round_trips_us(sender, receiver, message, count, repeats)
        results["shapes"][name] = {
            "bytes": sum(len(frame) for frame in plain.encode(message, None)),
            "frames": count,
            "plain_us": round(plain_us, 3),
            "mac_us": round(mac_us, 3),
            "added_us": round(mac_us - plain_us, 3),
            "ratio": round(mac_us / plain_us, 3),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = run(args.frames, args.repeats)
    for name, row in results["shapes"].items():
        print(f"{name:28} {row['bytes']:>8} B  plain {row['plain_us']:8.2f} us  "
              f"mac {row['mac_us']:8.2f} us  +{row['added_us']:.2f} us  x{row['ratio']:.2f}")
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
