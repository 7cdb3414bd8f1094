"""Random topologies: the writers of a room cover every decode rank's KV exactly once.

The coverage unit is (KV head, layer stage, token shard): with decode PP=1 every prefill PP
stage contributes its layers; with all CP ranks every CP rank contributes its tokens, else CP
rank 0 holds them all.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pdflow.core.cluster.topology import (
    AttentionKind,
    Parallelism,
    PdTopology,
    PrefillCoordinates,
    RankMapping,
    TopologyOptions,
    prefill_unique_rank,
    resolve_rank_mapping,
)
from pdflow.core.dataplane.layout import rank_head_range

EXAMPLES = settings(max_examples=int(os.environ.get("PDFLOW_EXAMPLES", "150")), deadline=None)

TP_SIZES = (1, 2, 4, 8)


@st.composite
def topologies(
    draw: st.DrawFn, kinds: tuple[AttentionKind, ...] = tuple(AttentionKind)
) -> PdTopology:
    attention = draw(st.sampled_from(kinds))
    prefill_tp, decode_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    # MHA: enough heads to split on both sides, or few heads that TP replicates.
    mha_heads = st.sampled_from((1, 2, 4, 8, 16, 32))
    heads = 1 if attention is AttentionKind.MLA else draw(mha_heads)
    prefill_pp = draw(st.integers(1, 3))
    decode_pp = draw(st.sampled_from((1, prefill_pp)))
    dp = draw(st.integers(1, 3))
    explicit_dp = draw(st.none() | st.integers(0, dp - 1))
    return PdTopology(
        prefill=Parallelism(tp=prefill_tp, cp=draw(st.integers(1, 3)), pp=prefill_pp, dp=dp),
        decode=Parallelism(tp=decode_tp, pp=decode_pp, dp=draw(st.integers(1, 2))),
        attention=attention,
        num_kv_heads=heads,
        options=TopologyOptions(all_cp_ranks=draw(st.booleans()), prefill_dp_rank=explicit_dp),
    )


def all_mappings(topology: PdTopology, room: int) -> list[RankMapping]:
    """Every decode rank of the room's decode DP group."""
    return [
        resolve_rank_mapping(topology, decode_engine_rank=tp, room=room, decode_pp_rank=pp)
        for tp in range(topology.decode.tp)
        for pp in range(topology.decode.pp)
    ]


def expected_cells(topology: PdTopology, m: RankMapping) -> Counter[tuple[int, int, int]]:
    heads = rank_head_range(topology.num_kv_heads, topology.decode.tp, m.decode_tp_rank)
    prefill = topology.prefill
    stages = range(prefill.pp) if topology.decode.pp < prefill.pp else (m.decode_pp_rank,)
    shards = range(prefill.cp) if topology.options.all_cp_ranks else (0,)
    return Counter(
        (head, stage, shard)
        for head in range(heads.start, heads.stop)
        for stage in stages
        for shard in shards
    )


def written_cells(m: RankMapping) -> Counter[tuple[int, int, int]]:
    cells: Counter[tuple[int, int, int]] = Counter()
    for writer in m.writers:
        assert writer.heads is not None, "a writer must say which heads it writes"
        shared = writer.heads.shared
        for head in range(shared.start, shared.stop):
            cells[(head, writer.rank.pp, writer.rank.cp)] += 1
    return cells


@EXAMPLES
@given(topology=topologies(), room=st.integers(0, 10_000))
def test_writers_cover_every_decode_rank_exactly_once(topology: PdTopology, room: int) -> None:
    for m in all_mappings(topology, room):
        assert written_cells(m) == expected_cells(topology, m)
        for writer in m.writers:
            assert writer.heads is not None
            heads = writer.heads
            assert heads.prefill_heads.start + heads.prefill_start == heads.shared.start
            assert heads.decode_heads.start + heads.decode_start == heads.shared.start
            assert heads.decode_start + heads.num_heads <= heads.decode_heads.count
            assert heads.prefill_start + heads.num_heads <= heads.prefill_heads.count


@EXAMPLES
@given(topology=topologies(), room=st.integers(0, 10_000))
def test_counts_agree_with_the_targets(topology: PdTopology, room: int) -> None:
    mappings = all_mappings(topology, room)
    metadata_from: Counter[PrefillCoordinates] = Counter()
    for m in mappings:
        assert len(m.writers) == m.required_prefill_response_num
        assert len({t.rank for t in m.targets}) == len(m.targets), "a rank is targeted once"
        metadata_from.update(t.rank for t in m.targets)
        dp_ranks = {t.rank.dp for t in m.targets}
        assert dp_ranks == {m.prefill_dp_rank}
        if topology.options.prefill_dp_rank is None:
            assert m.prefill_dp_rank == room % topology.prefill.dp
    prefill = topology.prefill
    # Every rank of the chosen DP group hears from exactly required_dst_info_num decode ranks.
    assert len(metadata_from) == prefill.ranks_per_dp_group
    assert set(metadata_from.values()) == {topology.required_dst_info_num}


@EXAMPLES
@given(topology=topologies(kinds=(AttentionKind.MLA,)), room=st.integers(0, 10_000))
def test_mla_has_one_writer_per_stage_and_shard(topology: PdTopology, room: int) -> None:
    for m in all_mappings(topology, room):
        per_cell = Counter((t.rank.pp, t.rank.cp) for t in m.writers)
        assert set(per_cell.values()) == {1}


@EXAMPLES
@given(tp=st.integers(1, 6), cp=st.integers(1, 6), pp=st.integers(1, 6))
def test_unique_rank_is_a_bijection(tp: int, cp: int, pp: int) -> None:
    prefill = Parallelism(tp=tp, cp=cp, pp=pp)
    ranks = {
        prefill_unique_rank(prefill, tp_rank=t, pp_rank=p, cp_rank=c)
        for t in range(tp)
        for p in range(pp)
        for c in range(cp)
    }
    assert ranks == set(range(tp * cp * pp))
