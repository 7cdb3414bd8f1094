"""pdflow's SGLang backend pieces that need no SGLang: KVArgs -> RankKv, refusals, imports."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from pdflow.core.dataplane.buffers import KvRole, PageOrder
from pdflow.core.dataplane.layout import StateKind, rank_head_range
from pdflow.sglang.layout import (
    UnsupportedByPdflow,
    rank_kv_from_kv_args,
    state_cross_tp_refusal,
    state_indices_for_pdflow,
)


def kv_args(**overrides: object) -> SimpleNamespace:
    """An SGLang KVArgs for an MHA pool: 2 layers, 9 pages of 4 tokens x 2 heads x 16 B."""
    item = 4 * 2 * 16
    ptrs = [0x10000 * (i + 1) for i in range(4)]
    fields: dict[str, object] = dict(
        kv_data_ptrs=ptrs, kv_data_lens=[9 * item] * 4, kv_item_lens=[item] * 4,
        kv_head_num=2, total_kv_head_num=4, page_size=4, state_types=[],
        num_draft_entries=0, kv_layout=None, pp_rank=0,
    )  # fmt: skip
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_kv_args_become_a_byte_exact_layout() -> None:
    rank = rank_kv_from_kv_args(kv_args(), tp_size=2, tp_rank=1, is_mla=False)
    kv = rank.kv_buffers
    assert [(b.addr, b.role, b.layer) for b in kv.buffers] == [
        (0x10000, KvRole.K, 0), (0x20000, KvRole.K, 1), (0x30000, KvRole.V, 0),
        (0x40000, KvRole.V, 1)]  # fmt: skip
    assert kv.num_pages == 9 and kv.page_size == 4
    assert {b.item_len for b in kv.buffers} == {128}
    assert {kv.head_bytes(b, rank.tp) for b in kv.buffers} == {16}
    assert (rank.tp_size, rank.tp_rank, rank.total_kv_heads) == (2, 1, 4)
    assert rank.heads == rank_head_range(4, 2, 1)


def test_mla_per_layer_item_lengths_and_hnd_pools_are_described_not_refused() -> None:
    mla = rank_kv_from_kv_args(
        kv_args(kv_data_ptrs=[0x10000, 0x20000, 0x30000], kv_data_lens=[9 * 576] * 3,
                kv_item_lens=[576] * 3, kv_head_num=1, total_kv_head_num=1),
        tp_size=2, tp_rank=1, is_mla=True)  # fmt: skip
    assert [(b.role, b.layer, b.total_heads) for b in mla.kv_buffers.buffers] == [
        (KvRole.LATENT, layer, 1) for layer in range(3)]  # fmt: skip
    mixed = rank_kv_from_kv_args(kv_args(kv_item_lens=[128, 64, 128, 64],
                                         kv_data_lens=[9 * 128, 9 * 64, 9 * 128, 9 * 64]),
                                 tp_size=2, tp_rank=1, is_mla=False)  # fmt: skip
    assert [mixed.kv_buffers.head_bytes(b, mixed.tp) for b in mixed.kv_buffers.buffers] == [
        16, 8, 16, 8]  # fmt: skip
    hnd = rank_kv_from_kv_args(kv_args(kv_layout="HND"), tp_size=2, tp_rank=1, is_mla=False)
    assert {b.order for b in hnd.kv_buffers.buffers} == {PageOrder.HND}


@pytest.mark.parametrize(
    ("overrides", "is_mla", "needle"),
    [
        ({"state_types": [SimpleNamespace(value="swa_ring")]}, False, "model state ['swa_ring']"),
        ({"num_draft_entries": 2}, False, "draft-model KV"),
        ({"kv_layout": "NCHW"}, False, "KV layout 'NCHW'"),
        ({"pp_rank": 1}, False, "pipeline parallelism"),
        ({"kv_data_ptrs": [1, 2, 3]}, True, "one latent buffer per layer"),
        ({"kv_data_ptrs": [1, 2, 3]}, False, "K and V buffers of every layer"),
        ({"kv_item_lens": [100] * 4, "kv_data_lens": [900] * 4}, False, "whole heads"),
    ],
)
def test_what_pdflow_cannot_move_is_refused_with_the_reason(
    overrides: dict[str, object], is_mla: bool, needle: str
) -> None:
    with pytest.raises(UnsupportedByPdflow) as refused:
        rank_kv_from_kv_args(kv_args(**overrides), tp_size=2, tp_rank=1, is_mla=is_mla)
    assert needle in str(refused.value)


def test_pdflow_imports_without_sglang() -> None:
    """pdflow's own import path never touches pdflow.sglang (SGLang is optional)."""
    code = (
        "import sys, pdflow, pdflow.cli, pdflow.io.node_decode, pdflow.io.node_prefill\n"
        "assert 'sglang' not in sys.modules, 'sglang imported'\n"
        "assert 'pdflow.sglang.conn' not in sys.modules, 'adapter imported'\n"
        "import pdflow.sglang.plugin, pdflow.sglang.layout\n"  # importable, SGLang or not
        "assert 'sglang' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_sglang_state_pools_become_pdflow_state_components_in_sglangs_order() -> None:
    """Mamba (a slot in a conv and an SSM buffer), SWA (window pages of 2 layers' K and V)
    and DSA (indexer-K pages): one component each, buffers and item counts as SGLang gave."""
    state = dict(
        state_types=[SimpleNamespace(value=name) for name in ("mamba", "swa", "dsa")],
        state_data_ptrs=[[0xA000, 0xB000], [0xC000, 0xC800, 0xD000, 0xD800], [0xE000]],
        state_data_lens=[[8 * 48, 8 * 80], [10 * 64] * 4, [10 * 32]],
        state_item_lens=[[48, 80], [64] * 4, [32]],
    )  # fmt: skip
    components = rank_kv_from_kv_args(kv_args(**state), tp_size=2, tp_rank=1, is_mla=False).state
    assert [c.kind for c in components] == [StateKind.MAMBA, StateKind.SWA, StateKind.BLOB]
    assert components[0].addrs == (0xA000, 0xB000) and components[0].item_lens == (48, 80)
    assert [c.num_items for c in components] == [8, 10, 10]
    assert components[1].addrs == (0xC000, 0xC800, 0xD000, 0xD800)


def test_state_buffers_of_different_item_counts_are_refused() -> None:
    state = dict(state_types=[SimpleNamespace(value="mamba")], state_data_ptrs=[[1, 2]],
                 state_data_lens=[[8 * 48, 9 * 80]], state_item_lens=[[48, 80]])  # fmt: skip
    with pytest.raises(UnsupportedByPdflow, match="different numbers of whole items"):
        rank_kv_from_kv_args(kv_args(**state), tp_size=2, tp_rank=1, is_mla=False)


def test_sglang_state_indices_become_one_index_list_per_component() -> None:
    # _mamba_payload gives [slot] (a 0-d array in a list); _swa_payload an index array.
    given = [[np.asarray(5)], np.asarray([7, 8, 9], dtype=np.int32), None]
    assert state_indices_for_pdflow(given, 3) == ((5,), (7, 8, 9), ())
    assert state_indices_for_pdflow(None, 3) == ()  # a chunk that is not the last
    assert state_indices_for_pdflow([None, None, None], 3) == ()
    with pytest.raises(UnsupportedByPdflow, match="for 2 state types"):
        state_indices_for_pdflow([[1], [2]], 3)


def _mamba(**fields: object) -> dict[str, object]:
    """One Mamba type: a conv buffer (4 channels x 12 B here) and an SSM buffer (1 head x
    80 B) per slot, 8 slots, as MambaPool describes them at attention TP 2."""
    state: dict[str, object] = dict(
        state_types=[SimpleNamespace(value="mamba")], state_data_ptrs=[[0xA000, 0xB000]],
        state_data_lens=[[8 * 48, 8 * 80]], state_item_lens=[[48, 80]],
        state_dim_per_tensor=[[4, 1]], state_slice_outer_counts=[[1, 1]],
        state_conv_shard_groups=[[None, None]],
    )  # fmt: skip
    state.update(fields)
    return state


def test_a_mamba_pool_is_split_over_tp_as_sglang_describes_it() -> None:
    (mamba,) = rank_kv_from_kv_args(kv_args(**_mamba()), tp_size=2, tp_rank=1,
                                    is_mla=False).state  # fmt: skip
    # This rank's 4 channels and 1 head of 8 and 2 over both ranks; one row each.
    assert (mamba.total_heads, mamba.tokens) == ((8, 2), 1)
    assert state_cross_tp_refusal(kv_args(**_mamba()), 2) == ""
    # A buffer every rank holds whole (SGLang's 0) is one "head" pdflow replicates.
    (replicated,) = rank_kv_from_kv_args(kv_args(**_mamba(state_dim_per_tensor=[[4, 0]])),
                                         tp_size=2, tp_rank=1, is_mla=False).state  # fmt: skip
    assert replicated.total_heads == (8, 1)
    # Rows outside the sliced axis (one count for the type) are pdflow's tokens.
    (rows,) = rank_kv_from_kv_args(kv_args(**_mamba(state_slice_outer_counts=[[2, 2]])),
                                   tp_size=2, tp_rank=1, is_mla=False).state  # fmt: skip
    assert (rows.total_heads, rows.tokens) == ((8, 2), 2)


@pytest.mark.parametrize("fields", [
    {"state_dim_per_tensor": [[]]},  # no split described
    {"state_slice_outer_counts": [[3, 1]]},  # Kimi's conv [K - 1, dim] beside a [dim] SSM
    {"state_conv_shard_groups": [[[2, 1, 1], None]]},  # GDN's [q | k | v] conv sub-blocks
])  # fmt: skip
def test_state_whose_tp_split_is_not_mapped_moves_only_between_equal_widths(
    fields: dict[str, object],
) -> None:
    (mamba,) = rank_kv_from_kv_args(kv_args(**_mamba(**fields)), tp_size=2, tp_rank=1,
                                    is_mla=False).state  # fmt: skip
    assert (mamba.total_heads, mamba.tokens) == ((), 1)  # whole items, as before
    assert "not ['mamba']" in state_cross_tp_refusal(kv_args(**_mamba(**fields)), 2)


def test_swa_and_dsa_state_are_refused_between_tp_widths() -> None:
    state = dict(state_types=[SimpleNamespace(value=name) for name in ("swa", "dsa")],
                 state_data_ptrs=[[0xC000], [0xE000]], state_data_lens=[[640], [320]],
                 state_item_lens=[[64], [32]])  # fmt: skip
    assert "not ['swa', 'dsa']" in state_cross_tp_refusal(kv_args(**state), 2)
    assert state_cross_tp_refusal(kv_args(), 2) == ""  # no model state: nothing to refuse
