"""SGLang's ``KVArgs`` as pdflow's buffer description, and what the adapter cannot move yet.

SGLang hands a transfer backend its KV pool as flat lists: ``kv_data_ptrs`` (K of every layer,
then V of every layer, each a buffer of pages), ``kv_data_lens`` (bytes per buffer) and
``kv_item_lens`` (bytes per page). pdflow's :class:`~pdflow.core.dataplane.layout.KvLayout`
describes the same memory as ``[page, token, head, dim]`` buffers. Only bytes move, so the
element type is described as bytes (``INT8``, ``head_dim`` = bytes per head): whole-page copies
and head slices are exact, and a dtype mismatch between the sides shows as a layout mismatch.

No SGLang import here: the checks run wherever pdflow runs.
"""

from __future__ import annotations

from typing import Any

from pdflow.core.dataplane.layout import AuxBuffer, KvDtype, KvLayout
from pdflow.io.kv_buffers import RankKv

# What the backend needs before it can serve each refused feature (docs/sglang.md).
FULL_PAYLOAD = "moving it needs pdflow's full payload (aux rows, model state, MLA, buffers)"


class UnsupportedByPdflow(ValueError):
    """SGLang asked for something pdflow's backend cannot move yet; says what and why."""


def rank_kv_from_kv_args(kv_args: Any, *, tp_size: int, is_mla: bool) -> RankKv:
    """The pdflow description of one SGLang rank's KV pool; refuses what it cannot move."""
    refuse_unsupported(kv_args, is_mla=is_mla)
    ptrs = [int(p) for p in kv_args.kv_data_ptrs]
    lens = [int(n) for n in kv_args.kv_data_lens]
    items = [int(n) for n in kv_args.kv_item_lens]
    if not ptrs or len(ptrs) % 2 or not len(ptrs) == len(lens) == len(items):
        raise UnsupportedByPdflow(
            f"pdflow expects K and V buffers of every layer (an even, non-empty list with one "
            f"length and item length each); SGLang gave {len(ptrs)} pointers, {len(lens)} "
            f"lengths, {len(items)} item lengths"
        )
    if len(set(items)) != 1 or len(set(lens)) != 1:
        raise UnsupportedByPdflow(
            f"pdflow needs every KV buffer to have one page size in bytes; got item lengths "
            f"{sorted(set(items))} and buffer lengths {sorted(set(lens))} (per-layer shapes: "
            f"{FULL_PAYLOAD})"
        )
    page_size = int(kv_args.page_size)
    heads = int(kv_args.kv_head_num)
    item_len = items[0]
    if item_len % (page_size * heads):
        raise UnsupportedByPdflow(
            f"a KV page of {item_len} bytes does not split into {page_size} tokens x {heads} "
            "heads; pdflow needs token-major pages ([page, token, head, dim])"
        )
    layers = len(ptrs) // 2
    layout = KvLayout(
        page_size=page_size, num_heads=heads, head_dim=item_len // (page_size * heads),
        dtype=KvDtype.INT8, num_pages=lens[0] // item_len,
        k_addrs=tuple(ptrs[:layers]), v_addrs=tuple(ptrs[layers:]),
    )  # fmt: skip
    return RankKv(layout, tp_size=tp_size, tp_rank=int(kv_args.engine_rank),
                  total_kv_heads=int(kv_args.total_kv_head_num),
                  aux=aux_buffer_from_kv_args(kv_args))  # fmt: skip


def aux_buffer_from_kv_args(kv_args: Any) -> AuxBuffer | None:
    """SGLang's metadata buffers (``aux_data_ptrs``/``_lens``/``_item_lens``, one item per
    request index in each) as pdflow's aux buffers; None when SGLang gave none."""
    ptrs = [int(p) for p in getattr(kv_args, "aux_data_ptrs", None) or []]
    if not ptrs:
        return None
    lens = [int(n) for n in kv_args.aux_data_lens]
    items = [int(n) for n in kv_args.aux_item_lens]
    rows = {length // item for length, item in zip(lens, items, strict=True)}
    if len(rows) != 1:
        raise UnsupportedByPdflow(
            f"SGLang's aux buffers hold different numbers of rows ({sorted(rows)}); pdflow "
            "indexes every aux buffer with the request's one aux index"
        )
    return AuxBuffer(tuple(ptrs), tuple(items), rows.pop())


def refuse_unsupported(kv_args: Any, *, is_mla: bool) -> None:
    """Raise for KV pools whose transfer needs what pdflow does not move yet."""
    problems: list[str] = []
    if is_mla:
        problems.append("MLA latent caches (one buffer per layer, no V)")
    if list(getattr(kv_args, "state_types", None) or []):
        names = [getattr(t, "value", str(t)) for t in kv_args.state_types]
        problems.append(f"model state {names} (Mamba, sliding-window, DSA...)")
    if int(getattr(kv_args, "num_draft_entries", 0) or 0):
        problems.append("draft-model KV (speculative decoding)")
    layout = getattr(kv_args, "kv_layout", None)
    if layout not in (None, "NHD"):
        problems.append(f"KV layout {layout!r} (pdflow pages are token-major, NHD)")
    if int(getattr(kv_args, "pp_rank", 0) or 0):
        problems.append("pipeline parallelism")
    if problems:
        raise UnsupportedByPdflow(
            "pdflow's SGLang backend cannot transfer " + "; ".join(problems) + f" yet: "
            f"{FULL_PAYLOAD}. Use --disaggregation-transfer-backend mooncake for this model."
        )
