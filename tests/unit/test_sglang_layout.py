"""pdflow's SGLang backend pieces that need no SGLang: KVArgs -> RankKv, refusals, imports."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from pdflow.core.dataplane.layout import rank_head_range
from pdflow.sglang.layout import UnsupportedByPdflow, rank_kv_from_kv_args


def kv_args(**overrides: object) -> SimpleNamespace:
    """An SGLang KVArgs for an MHA pool: 2 layers, 9 pages of 4 tokens x 2 heads x 16 B."""
    item = 4 * 2 * 16
    ptrs = [0x10000 * (i + 1) for i in range(4)]
    fields: dict[str, object] = dict(
        kv_data_ptrs=ptrs, kv_data_lens=[9 * item] * 4, kv_item_lens=[item] * 4,
        kv_head_num=2, total_kv_head_num=4, page_size=4, engine_rank=1, state_types=[],
        num_draft_entries=0, kv_layout=None, pp_rank=0,
    )  # fmt: skip
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_kv_args_become_a_byte_exact_layout() -> None:
    rank = rank_kv_from_kv_args(kv_args(), tp_size=2, is_mla=False)
    layout = rank.layout
    assert layout.k_addrs == (0x10000, 0x20000) and layout.v_addrs == (0x30000, 0x40000)
    assert layout.num_pages == 9 and layout.page_size == 4 and layout.num_heads == 2
    assert layout.item_len == 128 and layout.head_bytes == 16
    assert (rank.tp_size, rank.tp_rank, rank.total_kv_heads) == (2, 1, 4)
    assert rank.heads == rank_head_range(4, 2, 1)


@pytest.mark.parametrize(
    ("overrides", "is_mla", "needle"),
    [
        ({}, True, "MLA"),
        ({"state_types": [SimpleNamespace(value="mamba")]}, False, "model state ['mamba']"),
        ({"num_draft_entries": 2}, False, "draft-model KV"),
        ({"kv_layout": "HND"}, False, "KV layout 'HND'"),
        ({"pp_rank": 1}, False, "pipeline parallelism"),
        ({"kv_item_lens": [128, 128, 128, 64]}, False, "one page size in bytes"),
        ({"kv_data_ptrs": [1, 2, 3]}, False, "K and V buffers of every layer"),
        ({"kv_item_lens": [100] * 4, "kv_data_lens": [900] * 4}, False, "token-major"),
    ],
)
def test_what_pdflow_cannot_move_is_refused_with_the_reason(
    overrides: dict[str, object], is_mla: bool, needle: str
) -> None:
    with pytest.raises(UnsupportedByPdflow) as refused:
        rank_kv_from_kv_args(kv_args(**overrides), tp_size=2, is_mla=is_mla)
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
