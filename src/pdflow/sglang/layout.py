"""SGLang's ``KVArgs`` as pdflow's buffer description, and what the adapter cannot move yet.

SGLang hands a transfer backend its KV pool as flat lists: ``kv_data_ptrs`` (K of every layer,
then V of every layer, or one MLA latent buffer per layer, each a buffer of pages),
``kv_data_lens`` (bytes per buffer) and ``kv_item_lens`` (bytes per page, per buffer). pdflow's
:class:`~pdflow.core.dataplane.buffers.KvBuffers` describes the same memory tensor by tensor
(NHD or HND pages). Only bytes move, so the element type is described as bytes (``INT8``):
whole-page copies and head slices are exact, and a dtype mismatch between the sides shows as a
head-size mismatch.

No SGLang import here: the checks run wherever pdflow runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdflow.core.dataplane.buffers import KvBuffer, KvBuffers, KvRole, PageOrder
from pdflow.core.dataplane.layout import AuxBuffer, StateBuffers, StateKind
from pdflow.io.kv_buffers import RankKv

# What the backend needs before it can serve each refused feature (docs/sglang.md).
FULL_PAYLOAD = "docs/sglang.md lists what the adapter moves"


# SGLang's state types (``StateType`` values) whose indices name whole items of every buffer
# of the component, copied item for item between equal layouts: what pdflow's state moves.
# Mamba: the request's slot; SWA: its window's pages; DSA (NSA): its indexer-K pages.
ITEM_STATE_KINDS = {"mamba": StateKind.MAMBA, "swa": StateKind.SWA, "dsa": StateKind.BLOB}


class UnsupportedByPdflow(ValueError):
    """SGLang asked for something pdflow's backend cannot move yet; says what and why."""


def rank_kv_from_kv_args(kv_args: Any, *, tp_size: int, tp_rank: int, is_mla: bool) -> RankKv:
    """The pdflow description of one SGLang rank's KV pool; refuses what it cannot move.

    ``tp_size``/``tp_rank``: the rank's attention TP group and place in it. Not
    ``kv_args.engine_rank``: SGLang's prefill sets that to the global TP rank, which with
    attention DP also counts the DP groups before it."""
    refuse_unsupported(kv_args)
    ptrs = [int(p) for p in kv_args.kv_data_ptrs]
    lens = [int(n) for n in kv_args.kv_data_lens]
    items = [int(n) for n in kv_args.kv_item_lens]
    per_layer = 1 if is_mla else 2
    if not ptrs or len(ptrs) % per_layer or not len(ptrs) == len(lens) == len(items):
        what = "one latent buffer per layer" if is_mla else "K and V buffers of every layer"
        raise UnsupportedByPdflow(
            f"pdflow expects {what} (a non-empty list with one length and item length each); "
            f"SGLang gave {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} item lengths"
        )
    page_size = int(kv_args.page_size)
    heads = 1 if is_mla else int(kv_args.kv_head_num)
    for item_len in items:
        if item_len % (page_size * heads):
            raise UnsupportedByPdflow(
                f"a KV page of {item_len} bytes does not split into {page_size} tokens x "
                f"{heads} heads; pdflow needs pages of whole heads"
            )
    layers = len(ptrs) // per_layer
    total = 1 if is_mla else int(kv_args.total_kv_head_num)
    order = PageOrder.HND if getattr(kv_args, "kv_layout", None) == "HND" else PageOrder.NHD
    roles = (KvRole.LATENT,) if is_mla else (KvRole.K, KvRole.V)
    buffers = tuple(
        KvBuffer(addr, length, item_len, index % layers, roles[index // layers], total,
                 order=order)
        for index, (addr, length, item_len) in enumerate(zip(ptrs, lens, items, strict=True))
    )  # fmt: skip
    return RankKv(KvBuffers(page_size, buffers), tp_size=tp_size,
                  tp_rank=tp_rank, total_kv_heads=total,
                  aux=aux_buffer_from_kv_args(kv_args),
                  state=state_buffers_from_kv_args(kv_args, tp_size))  # fmt: skip


def state_buffers_from_kv_args(kv_args: Any, tp_size: int) -> tuple[StateBuffers, ...]:
    """SGLang's model-state pools (``state_types`` with ``state_data_ptrs``, ``_lens``,
    ``_item_lens``, one list per type) as pdflow's state components, in SGLang's order, so
    SGLang's ``state_indices`` (one entry per type) name them position for position; split
    over attention TP as ``tp_split_of_state`` says, where it can."""
    components = []
    for position, state_type in enumerate(getattr(kv_args, "state_types", None) or []):
        name = getattr(state_type, "value", str(state_type))
        ptrs = [int(p) for p in kv_args.state_data_ptrs[position]]
        lens = [int(n) for n in kv_args.state_data_lens[position]]
        items = [int(n) for n in kv_args.state_item_lens[position]]
        counts = {length // item for length, item in zip(lens, items, strict=True)}
        if len(counts) != 1:
            raise UnsupportedByPdflow(
                f"SGLang's {name} state buffers hold different numbers of whole items "
                f"(lengths {lens}, item lengths {items}); pdflow indexes every buffer of a "
                "state component with the same item indices"
            )
        split = tp_split_of_state(kv_args, position, tp_size)
        total_heads, tokens = split if split is not None else ((), 1)
        components.append(StateBuffers(ITEM_STATE_KINDS[name], tuple(ptrs), tuple(items),
                                       counts.pop(), total_heads, tokens))  # fmt: skip
    return tuple(components)


def tp_split_of_state(kv_args: Any, position: int,
                      tp_size: int) -> tuple[tuple[int, ...], int] | None:  # fmt: skip
    """How SGLang splits state type ``position`` over attention TP, as pdflow's
    ``StateBuffers.total_heads`` (per buffer) and ``tokens``; None where the adapter cannot
    say, so the state moves only between equal TP widths (item for item).

    SGLang gives a Mamba buffer's TP-sliced dimension per rank (``state_dim_per_tensor``: this
    rank's channels or heads; 0 for a buffer every rank holds whole) and the rows outside it
    (``state_slice_outer_counts``, 1 for ``[slice_dim, ...]``): an item is ``outer`` rows of
    this rank's ``dim`` "heads", which is pdflow's ``tokens`` x heads, with ``dim x tp_size``
    heads in all. Not mapped: other state types (SWA pages, DSA), buffers of one type with
    different outer counts (pdflow's ``tokens`` is per component), and GDN's conv state, whose
    ``[q | k | v]`` sub-blocks are each split over TP (``state_conv_shard_groups``)."""
    if getattr(kv_args.state_types[position], "value", None) != "mamba":
        return None
    dims = _per_type(kv_args, "state_dim_per_tensor", position)
    buffers = len(kv_args.state_data_ptrs[position])
    if len(dims) != buffers or any(_per_type(kv_args, "state_conv_shard_groups", position)):
        return None
    outer = _per_type(kv_args, "state_slice_outer_counts", position) or [1] * buffers
    sliced_outer = {int(count) for count, dim in zip(outer, dims, strict=False) if int(dim)}
    if len(sliced_outer) > 1:
        return None
    return (tuple(int(dim) * tp_size if int(dim) else 1 for dim in dims),
            sliced_outer.pop() if sliced_outer else 1)  # fmt: skip


def _per_type(kv_args: Any, name: str, position: int) -> list[Any]:
    """SGLang's per-state-type list ``name`` at ``position`` ([] where it gave none)."""
    lists = getattr(kv_args, name, None) or []
    return list(lists[position] or []) if position < len(lists) else []


def state_cross_tp_refusal(kv_args: Any, tp_size: int) -> str:
    """Why this rank's model state cannot move to or from a rank of another TP width ('' when
    every state type's TP split is known: ``tp_split_of_state``)."""
    names = [getattr(t, "value", str(t)) for t in getattr(kv_args, "state_types", None) or []]
    unmapped = [name for position, name in enumerate(names)
                if tp_split_of_state(kv_args, position, tp_size) is None]  # fmt: skip
    if not unmapped:
        return ""
    return (f"pdflow's SGLang backend moves model state between different attention TP "
            f"widths only for Mamba pools whose TP split SGLang describes "
            f"(state_dim_per_tensor, one outer count, no conv shard groups); not {unmapped}: "
            "run both roles with the same attention TP")


def state_indices_for_pdflow(state_indices: Sequence[Any] | None,
                             components: int) -> tuple[tuple[int, ...], ...]:  # fmt: skip
    """SGLang's ``state_indices`` (per state type: None, an index array, or a list of them, as
    its ``_mamba_payload`` gives ``[slot]``) as pdflow's index lists, one per component; ()
    when SGLang names no state for this call."""
    if not state_indices or all(entry is None for entry in state_indices):
        return ()
    if len(state_indices) != components:
        raise UnsupportedByPdflow(
            f"SGLang named state indices for {len(state_indices)} state types; this rank "
            f"described {components} to pdflow"
        )
    return tuple(_flat_indices(entry) for entry in state_indices)


def _flat_indices(entry: Any) -> tuple[int, ...]:
    if entry is None:
        return ()
    if isinstance(entry, list | tuple):
        parts = [np.asarray(part).reshape(-1) for part in entry]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    else:
        flat = np.asarray(entry).reshape(-1)
    return tuple(int(index) for index in flat)


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


def refuse_unsupported(kv_args: Any) -> None:
    """Raise for KV pools whose transfer needs what pdflow does not move yet."""
    problems: list[str] = []
    names = [getattr(t, "value", str(t)) for t in getattr(kv_args, "state_types", None) or []]
    unsupported = [name for name in names if name not in ITEM_STATE_KINDS]
    if unsupported:
        problems.append(f"model state {unsupported} (only {sorted(ITEM_STATE_KINDS)} move)")
    if int(getattr(kv_args, "num_draft_entries", 0) or 0):
        problems.append("draft-model KV (speculative decoding)")
    layout = getattr(kv_args, "kv_layout", None)
    if layout not in (None, "NHD", "HND"):
        problems.append(f"KV layout {layout!r} (pdflow pages are NHD or HND)")
    if int(getattr(kv_args, "pp_rank", 0) or 0):
        problems.append("pipeline parallelism")
    if problems:
        raise UnsupportedByPdflow(
            "pdflow's SGLang backend cannot transfer " + "; ".join(problems) + f" yet: "
            f"{FULL_PAYLOAD}. Use --disaggregation-transfer-backend mooncake for this model."
        )
