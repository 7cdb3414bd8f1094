"""Builders shared by the registry tests (no tests here): registrations, registries in a state."""

from __future__ import annotations

from typing import Any

from pdflow.core.cluster.registry import RegisterRank, Registry, RegistryState

TOKEN = "s3cret-token"


def rank(
    tp: int = 0, *, tp_size: int = 2, port: int | None = None, **overrides: Any
) -> RegisterRank:
    """A registration of TP rank ``tp`` of a TP=``tp_size`` prefill, SGLang's transcript fields."""
    fields: dict[str, Any] = {
        "attn_tp_size": tp_size, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
        "rank_port": 40001 + tp if port is None else port, "page_size": 1,
        "kv_cache_dtype": "auto", "load_balance_method": "follow_bootstrap_room",
        "prefill_http_port": 30000,
    }
    fields.update(overrides)
    return RegisterRank(**fields)


LIVE, LIVE_STARTED_AT = "p-live", 100.0
"""The incarnation (and its start time) that :func:`registry_in` registers its ranks with."""


def registry_in(state: RegistryState, *, token: str | None = None) -> Registry:
    """A TP=2 registry: COLLECTING holds rank 0, READY holds ranks 0 and 1, each registered by
    incarnation ``p-live`` (started at 100.0), which replaced ``p-gone`` on rank 0."""
    registry = Registry(token=token)
    registry.handle(rank(0, token=token, incarnation="p-gone", started_at=50.0), 0.5)
    ordered = {"incarnation": LIVE, "started_at": LIVE_STARTED_AT}
    registry.handle(rank(0, token=token, **ordered), 1.0)
    if state is RegistryState.READY:
        registry.handle(rank(1, token=token, **ordered), 1.0)
    assert registry.state is state
    return registry
