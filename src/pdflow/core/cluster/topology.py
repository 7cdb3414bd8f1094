"""Topology: which prefill ranks one decode rank exchanges with for a room, and how many.

A room's KV lives on one prefill DP group (chosen by the room, or given explicitly) spread over
its TP, CP and PP ranks. For one decode rank this module answers: which prefill ranks it sends
metadata to, which of them really write (the others are *dummies*: they get metadata only so
their sender leaves Bootstrapping, and write nothing), how many decode ranks each prefill rank
waits for (``required_dst_info_num``) and how many Success reports the decode waits for
(``required_prefill_response_num``). For writers it also gives the KV heads exchanged, so the
data plane can slice pages when the two sides use different TP sizes.

Heads follow :func:`pdflow.core.dataplane.layout.rank_head_range`. MLA is the case of one
latent "head" that every rank holds, which is why one rule picks writers for both kinds:
within the prefill TP ranks feeding one decode rank, the first rank holding each head range
writes it and the rest are dummies. For MHA/GQA without replicated heads that makes all
``pTP/dTP`` ranks writers; for MLA it makes exactly one.
"""

from __future__ import annotations

import enum
import itertools

import msgspec

from pdflow.core.dataplane.buffers import TpPlace, feeding_ranks, shared_heads
from pdflow.core.dataplane.layout import HeadRange, rank_head_range
from pdflow.core.framework.errors import InvalidInput

MLA_LATENT_HEADS = 1
"""MLA stores one compressed latent per token, replicated on every TP rank."""


class AttentionKind(enum.Enum):
    MHA = "mha"
    """Multi-head or grouped-query attention: KV heads are split over TP ranks."""
    MLA = "mla"
    """Multi-head latent attention: every TP rank holds the same latent."""


class Parallelism(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sizes of one side's parallel groups. ``tp`` is the attention TP size of one DP group."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} size must be >= 1, got {getattr(self, name)}")

    @property
    def ranks_per_dp_group(self) -> int:
        return self.tp * self.cp * self.pp


class PrefillCoordinates(msgspec.Struct, frozen=True, order=True, forbid_unknown_fields=True):
    """One prefill rank by its coordinates."""

    dp: int
    cp: int
    tp: int
    pp: int

    def unique_rank(self, prefill: Parallelism) -> int:
        """The rank's index inside its DP group: ``tp * (pp * cp) + pp * cp + cp``."""
        return prefill_unique_rank(prefill, tp_rank=self.tp, pp_rank=self.pp, cp_rank=self.cp)


def prefill_unique_rank(prefill: Parallelism, *, tp_rank: int, pp_rank: int, cp_rank: int) -> int:
    for name, rank, size in (
        ("tp_rank", tp_rank, prefill.tp),
        ("pp_rank", pp_rank, prefill.pp),
        ("cp_rank", cp_rank, prefill.cp),
    ):
        if not 0 <= rank < size:
            raise InvalidInput(f"prefill {name} {rank} is outside [0, {size})")
    return tp_rank * (prefill.pp * prefill.cp) + pp_rank * prefill.cp + cp_rank


class TopologyOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    all_cp_ranks: bool = False
    """Every prefill CP rank writes its share (x pCP responses); else CP rank 0 writes all."""
    prefill_dp_rank: int | None = None
    """An explicit prefill DP rank; ``None`` follows the bootstrap room (``room % dp``)."""


class HeadSlice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The KV heads one prefill rank writes into one decode rank (global head indices)."""

    prefill_heads: HeadRange
    decode_heads: HeadRange
    shared: HeadRange

    @property
    def prefill_start(self) -> int:
        """First shared head in the prefill rank's own head order."""
        return self.shared.start - self.prefill_heads.start

    @property
    def decode_start(self) -> int:
        """First shared head in the decode rank's own head order."""
        return self.shared.start - self.decode_heads.start

    @property
    def num_heads(self) -> int:
        return self.shared.count

    @property
    def whole_pages(self) -> bool:
        """Both ranks hold exactly the shared heads: pages can be copied whole."""
        return self.prefill_heads == self.shared == self.decode_heads


class RankTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One prefill rank of the room, as seen from one decode rank."""

    rank: PrefillCoordinates
    is_dummy: bool
    heads: HeadSlice | None
    """The heads written, for writers; ``None`` for dummies."""


class RankMapping(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    decode_tp_rank: int
    decode_pp_rank: int
    prefill_dp_rank: int
    targets: tuple[RankTarget, ...]
    required_dst_info_num: int
    required_prefill_response_num: int

    @property
    def writers(self) -> tuple[RankTarget, ...]:
        return tuple(t for t in self.targets if not t.is_dummy)


class PdTopology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Both sides' parallelism and the model's KV heads; validated once, on construction."""

    prefill: Parallelism
    decode: Parallelism
    attention: AttentionKind
    num_kv_heads: int = MLA_LATENT_HEADS
    options: TopologyOptions = TopologyOptions()

    def __post_init__(self) -> None:
        if self.decode.cp != 1:
            raise InvalidInput(
                f"decode context parallelism is not supported (decode cp={self.decode.cp}); "
                "run the decode side with cp=1"
            )
        small, large = sorted((self.prefill.tp, self.decode.tp))
        if large % small:
            raise InvalidInput(
                f"prefill TP={self.prefill.tp} and decode TP={self.decode.tp}: the larger must "
                "be a multiple of the smaller"
            )
        if self.decode.pp not in (1, self.prefill.pp):
            raise InvalidInput(
                f"decode PP={self.decode.pp} with prefill PP={self.prefill.pp}: decode PP must "
                "be 1 or equal to the prefill's, so the layer split lines up"
            )
        if self.attention is AttentionKind.MLA and self.num_kv_heads != MLA_LATENT_HEADS:
            raise InvalidInput(
                f"MLA has one latent KV head per token, got num_kv_heads={self.num_kv_heads}; "
                "pass num_kv_heads=1 for MLA"
            )
        # Both sides must split the heads evenly: rank_head_range says why when they cannot.
        rank_head_range(self.num_kv_heads, self.prefill.tp, 0)
        rank_head_range(self.num_kv_heads, self.decode.tp, 0)
        dp_rank = self.options.prefill_dp_rank
        if dp_rank is not None and not 0 <= dp_rank < self.prefill.dp:
            raise InvalidInput(
                f"prefill_dp_rank {dp_rank} is outside [0, {self.prefill.dp}); pick an existing "
                "prefill DP rank or None to follow the bootstrap room"
            )

    @property
    def required_dst_info_num(self) -> int:
        """Decode ranks each prefill rank hears from: ``dTP/pTP`` when decode TP is larger."""
        return max(1, self.decode.tp // self.prefill.tp)

    @property
    def required_prefill_response_num(self) -> int:
        """Success reports a decode rank waits for (counted from sizes, not from targets)."""
        if self.decode.tp >= self.prefill.tp:
            tp_writers = 1
        else:
            ranks_per_decode = self.prefill.tp // self.decode.tp
            decode_heads = rank_head_range(self.num_kv_heads, self.decode.tp, 0).count
            # Replicated prefill heads (MLA, or GQA with TP > heads) need only one writer each.
            tp_writers = min(ranks_per_decode, decode_heads)
        cp_writers = self.prefill.cp if self.options.all_cp_ranks else 1
        pp_writers = self.prefill.pp // self.decode.pp
        return tp_writers * cp_writers * pp_writers

    def prefill_dp_rank(self, room: int) -> int:
        if room < 0:
            raise InvalidInput(f"room must be >= 0, got {room}")
        explicit = self.options.prefill_dp_rank
        return explicit if explicit is not None else room % self.prefill.dp


def head_slice(topology: PdTopology, prefill_tp_rank: int, decode_tp_rank: int) -> HeadSlice | None:
    """The heads a prefill TP rank and a decode TP rank share, or ``None`` when disjoint."""
    prefill_heads = rank_head_range(topology.num_kv_heads, topology.prefill.tp, prefill_tp_rank)
    decode_heads = rank_head_range(topology.num_kv_heads, topology.decode.tp, decode_tp_rank)
    shared = prefill_heads.intersect(decode_heads)
    return None if shared is None else HeadSlice(prefill_heads, decode_heads, shared)


def _tp_writers(topology: PdTopology, decode_tp_rank: int) -> dict[int, HeadSlice | None]:
    """Prefill TP ranks feeding this decode TP rank, each with its slice (``None``: dummy)."""
    decode = TpPlace(topology.decode.tp, decode_tp_rank)
    return {
        tp_rank: (head_slice(topology, tp_rank, decode_tp_rank)
                  if shared_heads(topology.num_kv_heads, TpPlace(topology.prefill.tp, tp_rank),
                                  decode) is not None else None)
        for tp_rank in feeding_ranks(topology.prefill.tp, decode)
    }  # fmt: skip


def resolve_rank_mapping(
    topology: PdTopology, *, decode_engine_rank: int, room: int, decode_pp_rank: int = 0
) -> RankMapping:
    """The prefill ranks one decode rank talks to for ``room``, dummies included.

    ``decode_engine_rank`` counts over all decode DP groups (``[0, dp * tp)``); its attention TP
    rank is ``decode_engine_rank % decode tp``. Targets come in ``unique_rank`` order.
    """
    decode = topology.decode
    if not 0 <= decode_engine_rank < decode.dp * decode.tp:
        raise InvalidInput(
            f"decode engine rank {decode_engine_rank} is outside [0, {decode.dp * decode.tp})"
        )
    if not 0 <= decode_pp_rank < decode.pp:
        raise InvalidInput(f"decode pp rank {decode_pp_rank} is outside [0, {decode.pp})")
    dp_rank = topology.prefill_dp_rank(room)
    decode_tp_rank = decode_engine_rank % decode.tp
    tp_slices = _tp_writers(topology, decode_tp_rank)
    prefill = topology.prefill
    pp_ranks = range(prefill.pp) if decode.pp < prefill.pp else (decode_pp_rank,)
    targets = []
    for tp_rank, cp_rank, pp_rank in itertools.product(tp_slices, range(prefill.cp), pp_ranks):
        slice_ = tp_slices[tp_rank]
        # CP ranks other than 0 still get metadata, as dummies, so their senders leave
        # Bootstrapping instead of timing out; only the writing ranks report Success.
        writes = slice_ is not None and (topology.options.all_cp_ranks or cp_rank == 0)
        targets.append(
            RankTarget(
                rank=PrefillCoordinates(dp=dp_rank, cp=cp_rank, tp=tp_rank, pp=pp_rank),
                is_dummy=not writes,
                heads=slice_ if writes else None,
            )
        )
    targets.sort(key=lambda target: target.rank.unique_rank(prefill))
    return RankMapping(
        decode_tp_rank=decode_tp_rank,
        decode_pp_rank=decode_pp_rank,
        prefill_dp_rank=dp_rank,
        targets=tuple(targets),
        required_dst_info_num=topology.required_dst_info_num,
        required_prefill_response_num=topology.required_prefill_response_num,
    )
