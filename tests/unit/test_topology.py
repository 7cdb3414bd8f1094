"""Rank mapping, one case per row of the SGLang table plus CP, PP, DP and the errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdflow.core.cluster.topology import (
    AttentionKind,
    Parallelism,
    PdTopology,
    PrefillCoordinates,
    RankMapping,
    TopologyOptions,
    head_slice,
    prefill_unique_rank,
    resolve_rank_mapping,
)
from pdflow.core.dataplane.layout import HeadRange
from pdflow.core.framework.errors import InvalidInput

MHA, MLA = AttentionKind.MHA, AttentionKind.MLA


def mapping(
    prefill: Parallelism,
    decode: Parallelism,
    attention: AttentionKind = MHA,
    heads: int = 8,
    *,
    rank: int = 0,
    room: int = 0,
    pp_rank: int = 0,
    options: TopologyOptions = TopologyOptions(),  # noqa: B008 - immutable
) -> RankMapping:
    topology = PdTopology(prefill, decode, attention, heads if attention is MHA else 1, options)
    return resolve_rank_mapping(
        topology, decode_engine_rank=rank, room=room, decode_pp_rank=pp_rank
    )


def tp_of(m: RankMapping, *, writers_only: bool = False) -> list[int]:
    chosen = m.writers if writers_only else m.targets
    return [t.rank.tp for t in chosen]


def test_equal_tp_targets_the_same_rank_with_whole_pages() -> None:
    m = mapping(Parallelism(tp=4), Parallelism(tp=4), rank=2)
    assert tp_of(m) == [2] and tp_of(m, writers_only=True) == [2]
    assert (m.required_dst_info_num, m.required_prefill_response_num) == (1, 1)
    heads = m.targets[0].heads
    assert heads is not None and heads.whole_pages and heads.shared == HeadRange(4, 2)


def test_decode_tp_larger_shares_one_prefill_rank() -> None:
    m = mapping(Parallelism(tp=2), Parallelism(tp=8), rank=5)
    assert tp_of(m) == [1]
    assert (m.required_dst_info_num, m.required_prefill_response_num) == (4, 1)
    heads = m.writers[0].heads
    assert heads is not None
    # Decode rank 5 holds head 5; prefill rank 1 holds heads 4..7, so head 5 is its local 1.
    assert (heads.prefill_start, heads.decode_start, heads.num_heads) == (1, 0, 1)
    assert not heads.whole_pages


def test_decode_tp_smaller_mha_every_prefill_rank_writes() -> None:
    m = mapping(Parallelism(tp=8), Parallelism(tp=2), rank=1)
    assert tp_of(m) == [4, 5, 6, 7] and tp_of(m, writers_only=True) == [4, 5, 6, 7]
    assert (m.required_dst_info_num, m.required_prefill_response_num) == (1, 4)
    starts = [(t.heads.prefill_start, t.heads.decode_start) for t in m.writers if t.heads]
    assert starts == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_decode_tp_smaller_mla_one_writer_and_dummies() -> None:
    m = mapping(Parallelism(tp=8), Parallelism(tp=2), MLA, rank=1)
    assert tp_of(m) == [4, 5, 6, 7]
    assert tp_of(m, writers_only=True) == [4]
    assert [t.heads for t in m.targets if t.is_dummy] == [None, None, None]
    assert (m.required_dst_info_num, m.required_prefill_response_num) == (1, 1)


def test_replicated_gqa_heads_are_written_once() -> None:
    # 2 KV heads over prefill TP=4: ranks 0,1 hold head 0 and ranks 2,3 hold head 1.
    m = mapping(Parallelism(tp=4), Parallelism(tp=1), heads=2)
    assert tp_of(m, writers_only=True) == [0, 2]
    assert m.required_prefill_response_num == 2


def test_prefill_cp_pulls_from_rank_zero_and_keeps_others_as_dummies() -> None:
    m = mapping(Parallelism(tp=2, cp=3), Parallelism(tp=2), rank=1)
    assert [(t.rank.cp, t.is_dummy) for t in m.targets] == [(0, False), (1, True), (2, True)]
    assert m.required_prefill_response_num == 1


def test_all_cp_ranks_multiplies_responses() -> None:
    m = mapping(
        Parallelism(tp=2, cp=3),
        Parallelism(tp=2),
        rank=1,
        options=TopologyOptions(all_cp_ranks=True),
    )
    assert [t.rank.cp for t in m.writers] == [0, 1, 2]
    assert m.required_prefill_response_num == 3


def test_decode_pp_one_targets_every_prefill_stage() -> None:
    m = mapping(Parallelism(tp=2, pp=4), Parallelism(tp=1), rank=0)
    assert sorted({t.rank.pp for t in m.writers}) == [0, 1, 2, 3]
    assert m.required_prefill_response_num == 2 * 4


def test_equal_pp_targets_the_same_stage() -> None:
    m = mapping(Parallelism(tp=2, pp=2), Parallelism(tp=2, pp=2), rank=0, pp_rank=1)
    assert [(t.rank.tp, t.rank.pp) for t in m.targets] == [(0, 1)]
    assert m.required_prefill_response_num == 1


def test_dp_follows_the_room_or_an_explicit_rank() -> None:
    assert mapping(Parallelism(dp=4), Parallelism(), room=7).prefill_dp_rank == 3
    pinned = mapping(
        Parallelism(dp=4), Parallelism(), room=7, options=TopologyOptions(prefill_dp_rank=1)
    )
    assert pinned.prefill_dp_rank == 1
    assert {t.rank.dp for t in pinned.targets} == {1}


def test_decode_engine_rank_reduces_to_its_attention_tp_rank() -> None:
    first = mapping(Parallelism(tp=4), Parallelism(tp=2, dp=2), rank=1)
    second_group = mapping(Parallelism(tp=4), Parallelism(tp=2, dp=2), rank=3)
    assert first.targets == second_group.targets and second_group.decode_tp_rank == 1


def test_targets_come_in_unique_rank_order() -> None:
    prefill = Parallelism(tp=4, cp=2, pp=2)
    m = mapping(prefill, Parallelism(tp=1), rank=0)
    order = [t.rank.unique_rank(prefill) for t in m.targets]
    assert order == sorted(order) == list(range(16))


def test_unique_rank_formula() -> None:
    prefill = Parallelism(tp=3, cp=2, pp=5)
    assert prefill_unique_rank(prefill, tp_rank=2, pp_rank=4, cp_rank=1) == 2 * 10 + 4 * 2 + 1
    assert PrefillCoordinates(dp=9, cp=1, tp=0, pp=1).unique_rank(prefill) == 3
    with pytest.raises(InvalidInput, match="pp_rank 5"):
        prefill_unique_rank(prefill, tp_rank=0, pp_rank=5, cp_rank=0)


def test_head_slice_of_disjoint_ranks_is_none() -> None:
    topology = PdTopology(Parallelism(tp=4), Parallelism(tp=2), MHA, 8)
    assert head_slice(topology, 3, 0) is None


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: PdTopology(Parallelism(), Parallelism(cp=2), MHA, 8), "decode context"),
        (lambda: PdTopology(Parallelism(tp=3), Parallelism(tp=2), MHA, 6), "multiple"),
        (lambda: PdTopology(Parallelism(pp=4), Parallelism(pp=2), MHA, 8), "decode PP"),
        (lambda: PdTopology(Parallelism(tp=4), Parallelism(), MHA, 6), "split evenly"),
        (lambda: PdTopology(Parallelism(tp=4), Parallelism(), MHA, 3), "replicated"),
        (lambda: PdTopology(Parallelism(), Parallelism(), MLA, 8), "latent"),
        (
            lambda: PdTopology(
                Parallelism(dp=2), Parallelism(), MHA, 8, TopologyOptions(prefill_dp_rank=2)
            ),
            "prefill_dp_rank 2",
        ),
        (lambda: Parallelism(tp=0), "tp size"),
    ],
)
def test_unsupported_topologies_say_why(build: Callable[[], object], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        build()


def test_out_of_range_decode_ranks_and_rooms_are_refused() -> None:
    topology = PdTopology(Parallelism(pp=2), Parallelism(tp=2, pp=2), MHA, 8)
    with pytest.raises(InvalidInput, match="engine rank 2"):
        resolve_rank_mapping(topology, decode_engine_rank=2, room=0)
    with pytest.raises(InvalidInput, match="pp rank 2"):
        resolve_rank_mapping(topology, decode_engine_rank=0, room=0, decode_pp_rank=2)
    with pytest.raises(InvalidInput, match="room"):
        resolve_rank_mapping(topology, decode_engine_rank=0, room=-1)
