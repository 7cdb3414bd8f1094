"""(b) Many rooms in two processes over Mooncake TCP, driven as SGLang's schedulers drive a
backend (``driver.py``), every KV byte and every aux row checked, Success passing SGLang's own
aux-row metadata gate; and the same driver on SGLang's own mooncake
backend, which shows the driver is a faithful SGLang scheduler and gives the side-by-side
rooms/s (written to out/sglang/rooms_per_s.json)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.ports import free_port

from tests_sglang.processes import DriverProcess

OUT = Path(__file__).resolve().parents[1] / "out" / "sglang"
ROOMS = 96
GEOMETRY = ["--pages-per-room", "4", "--chunk-pages", "2", "--pool-pages", "1024",
            "--aux-slots", "256"]  # fmt: skip


def run_pair(backend: str, rooms: int, tmp_path: Path, *, both: tuple[str, ...] = (),
             decode_only: tuple[str, ...] = ()) -> dict[str, object]:  # fmt: skip
    """A prefill (hosting the bootstrap server) and a decode; ``rooms`` rooms opened at once.
    ``both``: more driver flags for both sides; ``decode_only``: for the decode only."""
    port = free_port()
    common = ["--backend", backend, "--bootstrap-port", str(port), *GEOMETRY, *both]
    prefill = DriverProcess("prefill", *common, "--serve-bootstrap", "--rooms", str(rooms),
                            "--room-base", "1000", "--http-port", str(free_port()),
                            log_dir=tmp_path)  # fmt: skip
    decode = DriverProcess("decode", *common, *decode_only, "--http-port", str(free_port()),
                           log_dir=tmp_path)  # fmt: skip
    try:
        prefill.wait_for("prefill_ready", timeout=240)
        decode.wait_for("decode_ready", timeout=240)
        decode.command(cmd="batch", count=rooms, base=1000, bootstrap_port=port)
        try:
            done = decode.wait_for("batch_done", timeout=120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; decode now: {decode.report()}; prefill: "
                                 f"{prefill.seen('prefill_idle')[-1:]}") from None
        prefill.wait_for("prefill_finished", timeout=60)
        senders = prefill.seen("sender_done")
        return {**done, "sender_done": len(senders),
                "bytes_per_room": sorted({s["bytes"] for s in senders}),
                "prefix_pages": sorted({s["prefix_pages"] for s in senders}),
                "policies": sorted({t["policy"] for t in decode.seen("prefill_topology")})}
    finally:
        decode.stop()
        prefill.stop()


@pytest.fixture(scope="module")
def side_by_side() -> Iterator[dict[str, dict]]:
    logs = OUT / "logs"
    results = {backend: run_pair(backend, ROOMS, logs) for backend in ("pdflow", "mooncake")}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rooms_per_s.json").write_text(json.dumps(results, indent=2) + "\n")
    print("rooms/s", {b: r["rooms_per_s"] for b, r in results.items()})
    yield results


def test_pdflow_backend_moves_every_room_byte_exact(side_by_side: dict[str, dict]) -> None:
    result = side_by_side["pdflow"]
    assert result["rooms"] == ROOMS and result["success"] == ROOMS, result
    assert result["wrong_pages"] == 0
    assert result["wrong_aux"] == 0  # every aux row landed (SGLang's gate let Success through)
    assert result["sender_done"] == ROOMS
    # 2 layers x K/V x 4 pages x (4 tokens x 2 heads x 16 floats x 4 B)
    assert result["bytes_per_room"] == [2 * 2 * 4 * 4 * 2 * 16 * 4]


def test_the_driver_is_an_sglang_scheduler_its_own_backend_passes(
    side_by_side: dict[str, dict],
) -> None:
    result = side_by_side["mooncake"]
    assert result["success"] == ROOMS and result["wrong_pages"] == result["wrong_aux"] == 0
