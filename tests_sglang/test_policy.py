"""SGLang's ``prefill_complete`` allocation policy through the pdflow backend: both sides run
with ``--disaggregation-decode-allocation-policy prefill_complete``; the prefill's sender
calls ``mark_prefill_complete()`` when its forward pass ended (before any destination
exists), the decode reserves pages only after pdflow's ready signal, and every room lands.
The prefill's registry tells the decode the policy (SGLang's ``PrefillServerInfo`` field).
The same driver on SGLang's mooncake backend shows the calls are SGLang's."""

from __future__ import annotations

from tests_sglang.test_driver import OUT, run_pair

ROOMS = 32
POLICY = ("--allocation-policy", "prefill_complete")


def test_prefill_complete_policy_through_the_pdflow_backend() -> None:
    result = run_pair("pdflow", ROOMS, OUT / "logs", both=POLICY)
    assert result["success"] == ROOMS, result
    assert result["wrong_pages"] == result["wrong_aux"] == 0
    assert result["policies"] == ["prefill_complete"]  # the prefill node took SGLang's policy


def test_sglang_mooncake_backend_takes_the_same_policy() -> None:
    result = run_pair("mooncake", 8, OUT / "logs", both=POLICY)
    assert result["success"] == 8 and result["wrong_pages"] == result["wrong_aux"] == 0, result
    assert result["policies"] == ["prefill_complete"]
