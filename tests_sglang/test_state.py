"""SGLang's model state (``KVArgs.state_types`` / ``state_data_ptrs``; here a Mamba pool, a
conv and an SSM buffer with one slot per request) through the pdflow backend: the manager
describes it to pdflow as a state component, the prefill names the request's slot on its
last chunk (``send(pages, [[slot]])``, as ``_mamba_payload`` does) and the decode its own slot
in ``send_metadata``; every slot's bytes land in the decode's slot, checked per room. The same
driver on SGLang's mooncake backend shows the calls are SGLang's."""

from __future__ import annotations

from tests_sglang.test_driver import OUT, run_pair

ROOMS = 32
MAMBA = ("--mamba-slots", "256")  # one slot per aux row (256 of them)


def test_mamba_state_moves_with_its_room_through_the_pdflow_backend() -> None:
    result = run_pair("pdflow", ROOMS, OUT / "logs", both=MAMBA)
    assert result["success"] == ROOMS, result
    assert result["wrong_pages"] == result["wrong_aux"] == 0
    assert result["wrong_state"] == 0  # conv and SSM slot of every room landed
    # KV (2 layers x K/V x 4 pages x 4 tokens x 2 heads x 16 floats x 4 B) + slot (12 + 20 floats)
    assert result["bytes_per_room"] == [2 * 2 * 4 * 4 * 2 * 16 * 4 + (12 + 20) * 4]


def test_sglang_mooncake_backend_moves_the_same_state() -> None:
    result = run_pair("mooncake", 8, OUT / "logs", both=MAMBA)
    assert result["success"] == 8 and result["wrong_state"] == 0, result
