"""The ``sglang.srt.plugins`` entry point: makes ``pdflow`` a transfer backend SGLang accepts.

SGLang 0.5.23 calls :func:`register` in every process (launcher, schedulers, detokenizer)
through ``sglang.srt.plugins.load_plugins``, then applies the hooks registered here. Three
things change, nothing else:

1. ``"pdflow"`` joins ``--disaggregation-transfer-backend``'s choices
   (``arg_groups.choices.add_disagg_transfer_backend_choices``).
2. ``disaggregation.utils.TransferBackend`` (a closed enum, built from the flag's string by the
   scheduler, ``disagg_service`` and ``multi_tokenizer_mixin``) is replaced by an enum with the
   same members plus ``PDFLOW``; ``get_kv_class`` is wrapped so ``PDFLOW`` yields pdflow's
   classes and every other backend still goes to SGLang's own code. The hook registry re-binds
   both names in every module that imported them.
3. ``decode.DecodeTransferQueue._defer_release`` is wrapped so a pdflow room's held pages get
   no release-anyway deadline: SGLang frees them only when
   :meth:`~pdflow.sglang.conn.PdflowKVManager.is_abort_release_safe` says pdflow released them.
   Other backends keep SGLang's deadline.
4. ``arg_groups.pd_disaggregation_hook._validate_prefill_complete`` is wrapped so SGLang's
   ``prefill_complete`` allocation policy accepts ``pdflow`` (SGLang 0.5.23 refuses every
   backend but Mooncake there, because only Mooncake implements ``mark_prefill_complete``;
   pdflow does). Every other refusal in that check stays SGLang's.

The plugin's own import touches no SGLang module, so a missing or broken SGLang shows in
SGLang's log as a failed plugin, not as a failed pdflow import.
"""

from __future__ import annotations

import enum
import math
from typing import Any

PDFLOW = "pdflow"
_CLASS_NAMES = {
    "manager": "PdflowKVManager",
    "sender": "PdflowKVSender",
    "receiver": "PdflowKVReceiver",
    "bootstrap_server": "PdflowKVBootstrapServer",
}


def register() -> None:
    """Entry point (``pdflow = "pdflow.sglang.plugin:register"``)."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pdflow.sglang.identity import instance_identity

    instance_identity()  # in the launcher: its children inherit this instance's identity
    if PDFLOW not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([PDFLOW])
    if not hasattr(utils.TransferBackend, "PDFLOW"):
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend",
                              extended_transfer_backend(utils.TransferBackend),
                              HookType.REPLACE)  # fmt: skip
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", route_kv_class,
                          HookType.AROUND)  # fmt: skip
    HookRegistry.register("sglang.srt.disaggregation.decode.DecodeTransferQueue._defer_release",
                          hold_until_pdflow_releases, HookType.AROUND)  # fmt: skip
    HookRegistry.register(
        "sglang.srt.arg_groups.pd_disaggregation_hook._validate_prefill_complete",
        allow_pdflow_prefill_complete, HookType.AROUND,
    )  # fmt: skip


# SGLang's refusal of prefill_complete for a backend other than Mooncake, by its own words.
_NOT_MOONCAKE = "transfer backends other than Mooncake"


def allow_pdflow_prefill_complete(original: Any, server_args: Any) -> Any:
    """SGLang's prefill_complete checks, minus "not Mooncake" when the backend is pdflow."""
    if getattr(server_args, "disaggregation_transfer_backend", None) != PDFLOW:
        return original(server_args)
    try:
        return original(server_args)
    except ValueError as exc:
        head, sep, listed = str(exc).partition("does not yet support ")
        others = [item for item in listed.split(", ") if item != _NOT_MOONCAKE]
        if not sep or len(others) == len(listed.split(", ")):
            raise  # not (only) the backend refusal: SGLang's reason stands as it is
        if others:
            raise ValueError(head + sep + ", ".join(others)) from None
        return None


def extended_transfer_backend(original: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's ``TransferBackend`` with the same members, plus ``PDFLOW``."""
    members = {member.name: member.value for member in original}
    members["PDFLOW"] = PDFLOW
    extended = enum.Enum(original.__name__, members, module=original.__module__,  # type: ignore[misc]
                         qualname=original.__qualname__)  # fmt: skip
    return extended


def route_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class``: pdflow's classes for ``pdflow``; SGLang's code for everything else."""
    if getattr(transfer_backend, "value", transfer_backend) != PDFLOW:
        return original(transfer_backend, class_type)
    if class_type.value == "kvargs":
        return original(transfer_backend, class_type)  # every backend shares SGLang's KVArgs
    from pdflow.sglang import conn

    return getattr(conn, _CLASS_NAMES[class_type.value])


def hold_until_pdflow_releases(original: Any, queue: Any, decode_req: Any) -> Any:
    """After SGLang records a held release, drop its deadline for pdflow rooms: SGLang's
    timeout cannot prove a write stopped; pdflow's ``PagesReleased`` can."""
    result = original(queue, decode_req)
    receiver = decode_req.kv_receiver
    if type(receiver).__name__ == "PdflowKVReceiver":
        entries = queue._deferred_releases
        for index in range(len(entries) - 1, -1, -1):
            if entries[index][0] is decode_req:
                request, start, _deadline, *rest = entries[index]
                entries[index] = (request, start, math.inf, *rest)
                break
    return result
