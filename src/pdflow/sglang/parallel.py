"""Where one SGLang scheduler process sits in its server's parallel layout, as pdflow's terms.

SGLang runs one scheduler per (DP group, attention TP rank); pdflow runs one node per scheduler,
with that process's one rank. SGLang's ``get_parallel()`` gives the widths and ranks; this maps
them onto a :class:`~pdflow.io.node_prefill.PrefillPlacement` (which DP group serves which
room) and the attention TP group the rank's KV heads are cut by, and refuses what the adapter
does not map yet (pipeline and context parallelism).
"""

from __future__ import annotations

from typing import Any

from pdflow.io.node_prefill import PrefillPlacement
from pdflow.sglang.layout import UnsupportedByPdflow


def refuse_unmapped_parallelism(parallel: Any) -> None:
    """PP and CP are not mapped by the adapter yet (pdflow's nodes take them)."""
    for name, size in (("pipeline parallelism", parallel.pp_size),
                       ("context parallelism", parallel.attn_cp_size)):  # fmt: skip
        if size and int(size) > 1:
            raise UnsupportedByPdflow(
                f"pdflow's SGLang backend does not support {name} (size {size}) yet: the "
                "adapter maps TP and attention DP only. Use --disaggregation-transfer-backend "
                "mooncake."
            )


def attention_tp(parallel: Any) -> tuple[int, int]:
    """(size, rank) of this process's attention TP group: what its KV heads are split by.
    With attention DP, SGLang's TP ranks are DP groups x attention TP ranks."""
    return int(parallel.attn_tp_size or 1), int(parallel.attn_tp_rank or 0)


def prefill_placement(parallel: Any, system_dp_rank: int | None, *,
                      force_query_dp_rank: bool = False) -> PrefillPlacement:  # fmt: skip
    """This prefill scheduler's DP group among the instance's ``num_dp_ranks`` groups.

    With attention DP the group is ``attn_dp_rank``; with DP replicas (``--dp-size`` without
    DP attention, one scheduler per replica) it is the replica's rank, which SGLang passes
    as ``kv_args.system_dp_rank`` (SGLang 0.5.23's own backends compare ``attn_dp_rank``,
    always 0 there, and so refuse every other room of a replica under follow_bootstrap_room).
    Rooms follow SGLang's ``--load-balance-method``: ``follow_bootstrap_room`` (room %
    dp_size), or any other method with the group registering each room it serves
    (``/register_dp_rank``) for the decode to query.

    ``force_query_dp_rank`` (SGLang's ``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK``,
    registering every room even under follow_bootstrap_room) is refused with DP: pdflow's
    nodes register rooms only under another load-balancing method, so a decode that queries
    would wait for an answer that never comes.
    """
    dp_size = int(getattr(parallel, "num_dp_ranks", None) or 1)
    if force_query_dp_rank and dp_size > 1:
        raise UnsupportedByPdflow(
            "pdflow's SGLang backend does not honour "
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK yet: unset it and pick a "
            "--load-balance-method other than follow_bootstrap_room for the prefill to "
            "register each room's DP group"
        )
    attn_dp_size = int(parallel.attn_dp_size or 1)
    dp_rank = int(parallel.attn_dp_rank or 0) if attn_dp_size > 1 else int(system_dp_rank or 0)
    return PrefillPlacement(dp_size=dp_size, dp_rank=dp_rank,
                            load_balance_method=parallel.load_balance_method)  # fmt: skip
