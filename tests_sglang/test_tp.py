"""Prefill TP=2 (two scheduler processes, one SGLang instance) -> decode TP=1 through the
SGLang backend: each decode page gets its two head slices from two prefill ranks, the ranks
reduce their polls over their gloo group as SGLang's prefill queues do; SGLang's checksum row
lands but is not offered for verification (no decode rank holds what one digest covered). The
instance's incarnation comes from the environment, as SGLang's launcher hands it to its ranks
(this test passes with per-rank incarnations too: it checks the transfer, not restart
detection). With a Mamba pool, each rank's share of the state goes the same way."""

from __future__ import annotations

import secrets
import time
from typing import Any

from tests.ports import free_port

from tests_sglang.processes import DriverProcess, run_batch
from tests_sglang.test_faults import LOGS

ROOMS = 16
GEOMETRY = ["--pages-per-room", "4", "--chunk-pages", "3", "--pool-pages", "256",
            "--aux-slots", "64", "--heads", "2", "--kv-checksum"]  # fmt: skip


def run_tp2_to_tp1(*flags: str) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """Two prefill ranks of one instance (TP 2) and a decode of TP 1; ``ROOMS`` rooms. Returns
    the decode's batch_done and each prefill rank's sender_done events."""
    port = free_port()
    store = LOGS / f"gloo-{secrets.token_hex(4)}"
    LOGS.mkdir(parents=True, exist_ok=True)
    instance = {"PDFLOW_SGLANG_INCARNATION": secrets.token_hex(8),
                "PDFLOW_SGLANG_STARTED_AT": repr(time.time())}  # fmt: skip
    common = ["--backend", "pdflow", "--bootstrap-port", str(port), *GEOMETRY, *flags]
    ranks = [
        DriverProcess("prefill", *common, "--serve-bootstrap", "--rooms", str(ROOMS),
                      "--room-base", "7000", "--tp-size", "2", "--tp-rank", str(rank),
                      "--gloo-store", str(store), "--http-port", str(free_port()),
                      env=instance, log_dir=LOGS)
        for rank in (0, 1)
    ]
    decode = DriverProcess("decode", *common, "--http-port", str(free_port()), log_dir=LOGS)
    try:
        done = run_batch(ranks, decode, rooms=ROOMS, base=7000, bootstrap_port=port)
        sent = []
        for process in ranks:
            process.wait_for("prefill_finished", timeout=60)
            sent.append(process.seen("sender_done"))
        return done, sent
    finally:
        for process in [decode, *ranks]:
            process.stop()
        store.unlink(missing_ok=True)


# One head of two: half of 2 layers x K/V x 4 pages x 4 tokens x 16 floats x 4 B.
HALF_KV = 2 * 2 * 4 * 4 * 1 * 16 * 4


def test_prefill_tp2_to_decode_tp1_moves_every_head_slice() -> None:
    done, sent = run_tp2_to_tp1()
    assert done["success"] == ROOMS and done["wrong_pages"] == done["wrong_aux"] == 0, done
    # Each decode page holds head slices of two prefill ranks' digests: not comparable.
    assert done["checksum_verified"] == 0
    for rank_sent in sent:
        assert len(rank_sent) == ROOMS
        assert {s["bytes"] for s in rank_sent} == {HALF_KV}


def test_prefill_tp2_to_decode_tp1_moves_each_ranks_share_of_the_mamba_state() -> None:
    """SGLang's Mamba pool split over attention TP (state_dim_per_tensor): each prefill rank
    holds half the conv channels and half the SSM heads of every slot; the decode's slot gets
    all of them, each from the rank that holds it."""
    done, sent = run_tp2_to_tp1("--mamba-slots", "64")
    assert done["success"] == ROOMS and done["wrong_pages"] == done["wrong_aux"] == 0, done
    assert done["wrong_state"] == 0  # every channel and head of every room's slot landed
    for rank_sent in sent:
        # Its half of the KV, and of the slot: 2 of 4 conv channels x 3 + 1 of 2 heads x 10.
        assert {s["bytes"] for s in rank_sent} == {HALF_KV + (2 * 3 + 1 * 10) * 4}
