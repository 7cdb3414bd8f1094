"""Prefill with attention DP 2 (two scheduler processes of one SGLang instance, one DP group
each, attention TP 1) feeding a decode of TP 1 through the SGLang backend. The decode finds
each room's prefill DP group with SGLang's own prealloc-queue code (``_resolve_pending_reqs``,
``prefetch_prefill_dp_rank_queries``): from the registry's topology under
``follow_bootstrap_room`` (room % 2), or, under ``round_robin``, by asking pdflow's registry
(SGLang's ``CommonKVReceiver.query_prefill_dp_ranks`` on ``/query_dp_ranks``) for the group
that registered the room; the driver's router sends each room to the other group than room % 2
then, so a decode that guessed would ask the wrong group. Every byte and aux row checked."""

from __future__ import annotations

import secrets
import time

import pytest
from tests.ports import free_port

from tests_sglang.processes import DriverProcess, run_batch
from tests_sglang.test_faults import LOGS

ROOMS = 16
GEOMETRY = ["--pages-per-room", "4", "--chunk-pages", "3", "--pool-pages", "256",
            "--aux-slots", "64"]  # fmt: skip


@pytest.mark.parametrize("load_balance_method", ["follow_bootstrap_room", "round_robin"])
def test_prefill_attention_dp2_each_room_lands_from_its_dp_group(load_balance_method: str) -> None:
    port = free_port()
    instance = {"PDFLOW_SGLANG_INCARNATION": secrets.token_hex(8),
                "PDFLOW_SGLANG_STARTED_AT": repr(time.time())}  # fmt: skip
    common = ["--backend", "pdflow", "--bootstrap-port", str(port),
              "--load-balance-method", load_balance_method, *GEOMETRY]  # fmt: skip
    groups = [
        DriverProcess("prefill", *common, "--dp-size", "2", "--serve-bootstrap",
                      "--rooms", str(ROOMS),
                      "--room-base", "9000", "--dp-rank", str(dp_rank),
                      "--http-port", str(free_port()), env=instance, log_dir=LOGS)
        for dp_rank in (0, 1)
    ]  # fmt: skip
    decode = DriverProcess("decode", *common, "--http-port", str(free_port()), log_dir=LOGS)
    try:
        done = run_batch(groups, decode, rooms=ROOMS, base=9000, bootstrap_port=port)
        assert done["success"] == ROOMS and done["wrong_pages"] == done["wrong_aux"] == 0, done
        topology = decode.wait_for("prefill_topology", timeout=1)
        assert topology["dp_size"] == 2
        assert topology["follow_bootstrap_room"] is (load_balance_method ==
                                                     "follow_bootstrap_room")  # fmt: skip
        served: dict[int, set[int]] = {}
        for dp_rank, process in enumerate(groups):
            process.wait_for("prefill_finished", timeout=60)
            served[dp_rank] = {s["room"] for s in process.seen("sender_done")}
            assert not process.seen("sender_failed")
        offset = 0 if load_balance_method == "follow_bootstrap_room" else 1
        for dp_rank, rooms in served.items():
            assert rooms == {r for r in range(9000, 9000 + ROOMS) if (r + offset) % 2 == dp_rank}
    finally:
        for process in [decode, *groups]:
            process.stop()
