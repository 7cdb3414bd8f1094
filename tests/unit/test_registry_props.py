"""Property: under any order of registrations (duplicates, restarts, bad tokens, inconsistent or
malformed ones), the registry is READY exactly when every distinct rank has registered, answers
each rank with its latest accepted registration, and a refused request changes nothing. A
registration must agree with the live ranks (those of no superseded life) only, and the topology
answer always describes a live one (a restarted prefill may change its page size)."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdflow.core.cluster.registry import QueryRank, QueryTopology, Registry, RegistryState
from tests.unit.test_registry_support import TOKEN, rank

EXAMPLES = settings(max_examples=int(os.environ.get("PDFLOW_EXAMPLES", "150")), deadline=None)

Key = tuple[int, int, int, int]


@st.composite
def scenario(draw: st.DrawFn) -> tuple[dict[str, int], list[tuple[Key, int, str, str]]]:
    sizes = {
        "dp": draw(st.integers(1, 2)), "cp": draw(st.integers(1, 2)),
        "tp": draw(st.integers(1, 3)), "pp": draw(st.integers(1, 2)),
    }
    key = st.tuples(*(st.integers(0, sizes[n] - 1) for n in ("dp", "cp", "tp", "pp")))
    # kind: ok | no_token | inconsistent | malformed
    kind = st.sampled_from(["ok", "ok", "ok", "no_token", "inconsistent", "malformed"])
    steps = draw(st.lists(
        st.tuples(key, st.integers(40000, 40999), st.sampled_from(["a", "b", "c"]), kind),
        max_size=30,
    ))
    return sizes, steps


@EXAMPLES
@given(scenario())
def test_readiness_is_distinct_ranks(
    case: tuple[dict[str, int], list[tuple[Key, int, str, str]]],
) -> None:
    sizes, steps = case
    world = sizes["dp"] * sizes["cp"] * sizes["tp"] * sizes["pp"]
    registry = Registry(token=TOKEN)
    accepted: dict[Key, tuple[int, str, int]] = {}  # port, incarnation, page size
    superseded: set[str] = set()  # incarnations a later one replaced on some rank
    for now, ((dp, cp, tp, pp), port, incarnation, kind) in enumerate(steps):
        fields: dict[str, Any] = dict(
            tp_size=sizes["tp"], port=port, incarnation=incarnation, token=TOKEN,
            attn_dp_size=sizes["dp"], attn_dp_rank=dp, attn_cp_size=sizes["cp"],
            attn_cp_rank=cp, pp_size=sizes["pp"], pp_rank=pp,
        )
        if kind == "no_token":
            fields["token"] = None
        elif kind == "inconsistent":
            fields["page_size"] = 32  # inconsistent only with an earlier, different first
        elif kind == "malformed":
            fields["pp_rank"] = sizes["pp"]
        before = registry.snapshot()
        reply = registry.reply_to(rank(tp, **fields), float(now))
        page_size = 32 if kind == "inconsistent" else 1
        key = (dp, cp, tp, pp)
        held = accepted.get(key)
        replaced = held[1] if held is not None and held[1] != incarnation else None
        live_pages = {page for other, (_, life, page) in accepted.items()
                      if other != key and life != replaced and life not in superseded}
        if kind == "no_token":
            expected = 401
        elif kind == "malformed":
            expected = 400
        elif incarnation in superseded:
            expected = 409
        elif live_pages - {page_size}:
            expected = 400
        else:
            expected = 200
        assert reply.status == expected, reply.body
        if expected == 200:
            if replaced is not None:
                superseded.add(replaced)
            accepted[key] = (port, incarnation, page_size)
        else:
            assert registry.snapshot() == before
        assert (registry.state is RegistryState.READY) == (len(accepted) == world)
        topology = registry.reply_to(QueryTopology(TOKEN), float(now))
        assert topology.status == (200 if len(accepted) == world else 503)
        if topology.status == 503:
            assert f"({len(accepted)} workers registered)" in str(topology.body)
        else:
            assert isinstance(topology.body, dict)
            assert topology.body["page_size"] in {page for _, life, page in accepted.values()
                                                  if life not in superseded}
    if len(accepted) == world:
        for (dp, cp, tp, pp), (port, incarnation, _) in accepted.items():
            body = registry.reply_to(QueryRank(dp, cp, tp, pp, TOKEN), 99.0).body
            assert body == {"rank_ip": "127.0.0.1", "rank_port": port,
                            "incarnation": incarnation}
