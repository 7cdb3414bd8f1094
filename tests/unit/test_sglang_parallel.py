"""SGLang's parallel layout of one scheduler process as pdflow's placement (sglang/parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdflow.sglang.layout import UnsupportedByPdflow, rank_kv_from_kv_args
from pdflow.sglang.parallel import attention_tp, prefill_placement, refuse_unmapped_parallelism
from tests.unit.test_sglang_layout import kv_args


def parallel(**overrides: object) -> SimpleNamespace:
    """SGLang's get_parallel() of one scheduler: TP 1, no DP, by default."""
    fields: dict[str, object] = dict(
        attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1, attn_dp_rank=0, attn_cp_size=1,
        pp_size=1, num_dp_ranks=1, load_balance_method="follow_bootstrap_room",
    )  # fmt: skip
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_attention_dp_group_is_the_dp_rank_and_the_kv_is_cut_by_attention_tp() -> None:
    # SGLang --tp 4 --dp 2 --enable-dp-attention, TP rank 3: DP group 1, attention TP rank 1.
    layout = parallel(attn_tp_size=2, attn_tp_rank=1, attn_dp_size=2, attn_dp_rank=1,
                      num_dp_ranks=2, load_balance_method="round_robin")  # fmt: skip
    place = prefill_placement(layout, system_dp_rank=0)
    assert (place.dp_size, place.dp_rank, place.follows_bootstrap_room) == (2, 1, False)
    assert attention_tp(layout) == (2, 1)
    # SGLang's prefill passes its global TP rank (3) as engine_rank; pdflow's rank is 1 of 2.
    rank = rank_kv_from_kv_args(kv_args(engine_rank=3), tp_size=2, tp_rank=1, is_mla=False)
    assert (rank.tp_size, rank.tp_rank) == (2, 1)


def test_dp_replicas_are_placed_by_their_replica_rank() -> None:
    # --dp 2 without DP attention: one scheduler per replica, attn_dp_rank 0 in both.
    place = prefill_placement(parallel(num_dp_ranks=2), system_dp_rank=1)
    assert (place.dp_size, place.dp_rank, place.follows_bootstrap_room) == (2, 1, True)
    assert place.refusal(9001) == ""  # 9001 % 2 == 1: this replica's room
    assert "DP rank 0" in place.refusal(9000)


def test_no_dp_is_one_group() -> None:
    place = prefill_placement(parallel(load_balance_method=None), system_dp_rank=None)
    assert (place.dp_size, place.dp_rank, place.follows_bootstrap_room) == (1, 0, True)


@pytest.mark.parametrize(("field", "name"),
                         [("pp_size", "pipeline"), ("attn_cp_size", "context")])  # fmt: skip
def test_pipeline_and_context_parallelism_are_refused_with_the_reason(field: str,
                                                                     name: str) -> None:
    with pytest.raises(UnsupportedByPdflow, match=f"{name} parallelism \\(size 2\\)"):
        refuse_unmapped_parallelism(parallel(**{field: 2}))
    refuse_unmapped_parallelism(parallel())  # TP and DP only: nothing refused


def test_forcing_dp_rank_queries_is_refused_with_dp_and_ignored_without() -> None:
    with pytest.raises(UnsupportedByPdflow, match="FORCE_QUERY_PREFILL_DP_RANK"):
        prefill_placement(parallel(num_dp_ranks=2, attn_dp_size=2), 0, force_query_dp_rank=True)
    assert prefill_placement(parallel(), 0, force_query_dp_rank=True).dp_size == 1
