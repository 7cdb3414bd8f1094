"""The pure bootstrap registry: every row of its table, and scenarios on a virtual clock."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pdflow.core.cluster.registry import (
    MAX_INCARNATION_CHARS,
    REGISTRY_TABLE,
    STARTED_AT_TOLERANCE_S,
    SUPERSEDED_MEMORY,
    CheckHealth,
    PrefillRankInfo,
    PrefillServerInfo,
    QueryDpRanks,
    QueryRank,
    QueryTopology,
    RegisterDpRank,
    Registry,
    RegistryState,
    Reply,
    declared_staging_slot_bytes,
    route_query,
)
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.core.protocol.policy import AllocationPolicy
from tests.unit.test_registry_support import TOKEN, rank, registry_in

_C, _R = RegistryState.COLLECTING, RegistryState.READY
NOT_READY_0 = "Prefill server not fully registered yet (0 workers registered)."
NOT_READY_1 = "Prefill server not fully registered yet (1 workers registered)."

# One probe per row of the table: (state, input, guard) -> (probe, status of the reply or None).
ROW_PROBES: dict[tuple[RegistryState, str, str | None], tuple[Input, int | None]] = {}
for _state in RegistryState:
    ROW_PROBES |= {
        (_state, "RegisterRank", "unauthorized"): (rank(1), 401),
        (_state, "RegisterRank", "malformed"): (rank(1, attn_tp_rank=5, token=TOKEN), 400),
        (_state, "RegisterRank", "superseded"): (rank(1, incarnation="p-gone", token=TOKEN), 409),
        (_state, "RegisterRank", "inconsistent"): (rank(1, page_size=16, token=TOKEN), 400),
        (_state, "RegisterDpRank", "unauthorized"): (RegisterDpRank(7, 0), 401),
        (_state, "RegisterDpRank", "bad_dp_rank"): (RegisterDpRank(7, 3, TOKEN), 400),
        (_state, "RegisterDpRank", None): (RegisterDpRank(7, 0, TOKEN), 200),
        (_state, "QueryDpRanks", "unauthorized"): (QueryDpRanks((7,)), 401),
        (_state, "QueryDpRanks", None): (QueryDpRanks((7,), TOKEN), 200),
        (_state, "QueryTopology", "unauthorized"): (QueryTopology("wrong"), 401),
        (_state, "QueryRank", "unauthorized"): (QueryRank(0, 0, 0, 0), 401),
        (_state, "Tick", None): (Tick(), None),
        (_state, "CheckHealth", None): (CheckHealth(), 200),
    }
ROW_PROBES |= {
    (_C, "RegisterRank", "completes_topology"): (rank(1, token=TOKEN), 200),
    (_C, "RegisterRank", None): (rank(0, port=40009, token=TOKEN), 200),
    (_C, "QueryTopology", None): (QueryTopology(TOKEN), 503),
    (_C, "QueryRank", None): (QueryRank(0, 0, 0, 0, TOKEN), 503),
    (_R, "RegisterRank", None): (rank(0, port=40009, token=TOKEN), 200),
    (_R, "QueryTopology", None): (QueryTopology(TOKEN), 200),
    (_R, "QueryRank", "rank_registered"): (QueryRank(0, 0, 1, 0, TOKEN), 200),
    (_R, "QueryRank", None): (QueryRank(0, 0, 5, 0, TOKEN), 404),
}


def _reply(registry: Registry, inp: Input, now: float = 2.0) -> Reply:
    return registry.reply_to(inp, now)


def test_every_row_has_a_probe() -> None:
    rows = {(r.source, r.on, r.guard) for r in REGISTRY_TABLE.rows}
    assert rows == set(ROW_PROBES)


@pytest.mark.parametrize(
    "key", sorted(ROW_PROBES, key=str), ids=[f"{s.name}-{on}-{g or '-'}" for s, on, g in
                                               sorted(ROW_PROBES, key=str)]
)
def test_every_row_answers_as_specified(key: tuple[RegistryState, str, str | None]) -> None:
    state, on, guard = key
    probe, status = ROW_PROBES[key]
    registry = registry_in(state, token=TOKEN)
    before = registry.snapshot()
    step = registry.handle(probe, 2.0)
    (fired,) = step.fired
    (expected,) = [r for r in REGISTRY_TABLE.cell(state, on) if r.guard == guard]
    assert (fired.source, fired.on, fired.guard, fired.target) == (
        state.name, on, guard, expected.target.name
    )
    replies = [o for o in step.outputs if isinstance(o, Reply)]
    assert [r.status for r in replies] == ([] if status is None else [status])
    if status is not None and status >= 400:
        assert registry.snapshot() == before, "a refused request must change nothing"


@pytest.mark.parametrize("state", list(RegistryState))
@pytest.mark.parametrize("on", REGISTRY_TABLE.inputs)
def test_every_cell_is_defined(state: RegistryState, on: str) -> None:
    # The registry answers every request in every state: no cell may raise a ProtocolError.
    rows = REGISTRY_TABLE.cell(state, on)
    assert rows and rows[-1].guard is None


# ---- scenarios ----------------------------------------------------------------------------
def test_fresh_registry_is_healthy_and_not_ready() -> None:
    registry = Registry()
    assert _reply(registry, CheckHealth()) == Reply(200, "OK")
    assert _reply(registry, QueryTopology()) == Reply(503, NOT_READY_0)
    assert _reply(registry, QueryRank(0, 0, 0, 0)) == Reply(503, NOT_READY_0)


def test_ready_counts_distinct_ranks_and_reregistration_replaces() -> None:
    registry = Registry()
    assert _reply(registry, rank(0)) == Reply(200, "OK")
    assert _reply(registry, QueryTopology()) == Reply(503, NOT_READY_1)
    # SGLang counts this second PUT of rank 0 and reports ready; pdflow does not.
    assert _reply(registry, rank(0, port=40003)) == Reply(200, "OK")
    assert registry.snapshot().state == "COLLECTING"
    assert _reply(registry, QueryTopology()) == Reply(503, NOT_READY_1)
    assert _reply(registry, rank(1)) == Reply(200, "OK")
    assert registry.snapshot().state == "READY"
    assert _reply(registry, QueryRank(0, 0, 0, 0)) == Reply(
        200, {"rank_ip": "127.0.0.1", "rank_port": 40003}
    )
    assert _reply(registry, QueryRank(0, 0, 1, 0)) == Reply(
        200, {"rank_ip": "127.0.0.1", "rank_port": 40002}
    )
    assert _reply(registry, QueryRank(0, 0, 5, 0)) == Reply(
        404, "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=5 pp_rank=0"
    )


def test_topology_answer_has_exactly_sglang_prefill_server_info_fields() -> None:
    registry = registry_in(_R)
    reply = _reply(registry, QueryTopology())
    assert reply.status == 200
    assert reply.body == {
        "attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 1,
        "kv_cache_dtype": "auto", "follow_bootstrap_room": True,
        "enable_dsa_cache_layer_split": False, "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False, "prefill_http_port": 30000, "target_tp_rank": None,
        "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None,
        "required_dst_info_num": None, "required_prefill_response_num": None,
    }
    assert msgspec.convert(reply.body, PrefillServerInfo).attn_tp_size == 2


def test_topology_carries_layout_and_load_balance_method() -> None:
    layout = {"block_size": 4}
    registry = Registry()
    for tp in (0, 1):
        registry.handle(rank(tp, dsv41_spec_layout=layout, load_balance_method="total_tokens",
                             decode_allocation_policy=AllocationPolicy.PREFILL_COMPLETE), 0.0)
    body = _reply(registry, QueryTopology()).body
    assert isinstance(body, dict)
    assert body["dsv41_spec_layout"] == layout
    assert body["follow_bootstrap_room"] is False
    assert body["decode_allocation_policy"] == "prefill_complete"


CONSISTENT: list[tuple[str, Any, str]] = [
    ("attn_tp_size", 4, "Inconsistent prefill topology"),
    ("attn_cp_size", 2, "Inconsistent prefill topology"),
    ("attn_dp_size", 2, "Inconsistent prefill topology"),
    ("system_dp_size", 2, "Inconsistent prefill topology"),
    ("pp_size", 2, "Inconsistent prefill topology"),
    ("page_size", 64, "Inconsistent prefill page size"),
    ("kv_cache_dtype", "fp8_e4m3", "Inconsistent prefill KV cache dtype"),
    ("decode_allocation_policy", AllocationPolicy.PREFILL_COMPLETE,
     "Inconsistent prefill allocation policies"),
    ("dsv41_spec_layout", {"block_size": 4},
     "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks"),
    ("protocol_version", 2, "Inconsistent pdflow protocol versions"),
    ("checksum", True, "Inconsistent prefill KV checksum settings"),
    ("is_mla", True, "Inconsistent prefill attention kinds"),
    ("prefill_http_port", 31000, "Inconsistent prefill HTTP ports"),
    ("load_balance_method", "round_robin", "Inconsistent prefill load balance methods"),
    ("enable_dsa_cache_layer_split", True, "Inconsistent prefill DSA cache layer split"),
    ("enable_kv_cache_sharding", True, "Inconsistent prefill KV cache sharding"),
]


@pytest.mark.parametrize("state", list(RegistryState))
@pytest.mark.parametrize(("field", "value", "headline"), CONSISTENT)
def test_inconsistent_registration_is_refused_naming_field_and_values(
    state: RegistryState, field: str, value: Any, headline: str
) -> None:
    registry = registry_in(state)
    before = registry.snapshot()
    reply = _reply(registry, rank(1, **{field: value}))
    assert reply.status == 400
    assert isinstance(reply.body, str) and reply.body.startswith(headline)
    assert f"{field}=" in reply.body and "dp=0 cp=0 tp=0 pp=0" in reply.body
    assert "start this rank with" in reply.body, "the answer says what to do"
    shown = value.value if isinstance(value, AllocationPolicy) else value
    assert repr(shown) in reply.body
    assert registry.snapshot() == before


def test_no_load_balance_method_is_follow_bootstrap_room() -> None:
    registry = registry_in(_C)  # rank 0 sent follow_bootstrap_room
    assert _reply(registry, rank(1, load_balance_method=None)).status == 200


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"attn_tp_rank": 2}, "attn_tp_rank=2 must be in [0, attn_tp_size=2)"),
        ({"attn_tp_rank": -1}, "attn_tp_rank=-1"),
        ({"attn_tp_size": 0}, "attn_tp_size=0 must be in [1, 1048576]"),
        ({"page_size": 0}, "page_size=0 must be in [1, 1048576]"),
        ({"page_size": 2**63 - 1}, "page_size=9223372036854775807 must be in [1, 1048576]"),
        ({"pp_rank": 1}, "pp_rank=1 must be in [0, pp_size=1)"),
        ({"attn_dp_rank": 1}, "attn_dp_rank=1"),
        ({"system_dp_rank": 3, "system_dp_size": 2}, "system_dp_rank=3"),
        ({"rank_port": 0}, "rank_port=0"),
        ({"rank_port": 70000}, "rank_port=70000"),
        ({"rank_ip": ""}, "rank_ip"),
        ({"rank_ip": " \n"}, "rank_ip=' \\n' must be a host name or address"),
        ({"rank_ip": "h" * 256}, "at most 255 characters"),
        ({"health": "a host:80"}, "health='a host:80'"),
        ({"protocol_version": -1}, "protocol_version=-1 must be >= 0"),
        ({"kv_cache_dtype": ""}, "kv_cache_dtype"),
        ({"incarnation": ""}, "incarnation"),
        ({"incarnation": "p", "started_at": -1.0}, "started_at=-1.0 must be seconds"),
        ({"incarnation": "p", "started_at": float("nan")}, "started_at=nan"),
        ({"started_at": 5.0}, "send an incarnation too"),
        ({"health": "nohost"}, "health='nohost' must be host:port"),
        ({"health": "h:0"}, "health='h:0'"),
        # str.isdigit() takes these; int() raised on '²' (a 500) and read Arabic-Indic digits.
        ({"health": "h:\u00b2"}, "the port in ASCII digits"),
        ({"health": "h:\u0668\u0660"}, "the port in ASCII digits"),
        ({"health": "h:65536"}, "health='h:65536'"),
        ({"health": "h:" + "9" * 5000}, "(5002 characters)"),
        ({"staging_slot_bytes": -1}, "staging_slot_bytes=-1 must be >= 0"),
        ({"prefill_http_port": 0}, "prefill_http_port=0 must be in [1, 65535]"),
        ({"prefill_http_port": 2**63 - 1}, "prefill_http_port=9223372036854775807"),
        ({"incarnation": "p" * (MAX_INCARNATION_CHARS + 1)},
         f"at most {MAX_INCARNATION_CHARS} are allowed"),
        ({"incarnation": "p", "started_at": 1e300, "received_at": 1000.0},
         "a process cannot start in the future"),
        ({"incarnation": "p", "started_at": 1000.0 + STARTED_AT_TOLERANCE_S + 1,
          "received_at": 1000.0}, "fix the prefill host's clock"),
    ],
)
def test_malformed_registration_is_refused_and_changes_nothing(
    overrides: dict[str, Any], needle: str
) -> None:
    for registry in (Registry(), registry_in(_C)):
        before = registry.snapshot()
        reply = _reply(registry, rank(0, **overrides))
        assert reply.status == 400
        assert isinstance(reply.body, str) and needle in reply.body
        assert registry.snapshot() == before


def test_the_largest_incarnation_and_a_skewed_clock_within_the_tolerance_are_taken() -> None:
    registry = Registry()
    ahead = 1000.0 + STARTED_AT_TOLERANCE_S
    reply = _reply(registry, rank(0, incarnation="p" * MAX_INCARNATION_CHARS, started_at=ahead,
                                  received_at=1000.0, health="h:65535"))
    assert reply == Reply(200, "OK")
    held = registry.snapshot().registrations[0][1]
    assert held.received_at is None and held.token is None, "only the sender's fields are kept"


def test_a_start_time_far_in_the_future_cannot_lock_a_rank() -> None:
    """Before: started_at=1e300 was taken, and every later life of the rank got 409."""
    registry = Registry()
    hostile = rank(0, incarnation="p-skewed", started_at=1e300, received_at=1000.0)
    assert _reply(registry, hostile).status == 400
    restart = rank(0, incarnation="p-real", started_at=990.0, received_at=1000.0)
    assert _reply(registry, restart) == Reply(200, "OK")


def test_inputs_never_show_the_token() -> None:
    """A log line or a traceback that prints an input must not leak the shared token."""
    from rich.pretty import pretty_repr

    for inp in (rank(0, token=TOKEN), QueryTopology(TOKEN), QueryRank(0, 0, 0, 0, TOKEN),
                RegisterDpRank(1, 0, TOKEN), QueryDpRanks((1,), TOKEN)):
        for shown in (repr(inp), str(inp), f"{inp!r}", pretty_repr(inp)):
            assert TOKEN not in shown and "<hidden>" in shown, shown
    assert "token=None" in repr(QueryTopology())
    assert msgspec.json.decode(msgspec.json.encode(rank(0, token=TOKEN)))["token"] == TOKEN


def test_token_guards_every_request_but_health() -> None:
    """Reads too: GET /route hands out the identity (address, incarnation, rank) of every
    prefill rank, which was all a forger needed."""
    registry = Registry(token=TOKEN)
    for bad in (None, "wrong", TOKEN + "x", ""):
        reply = _reply(registry, rank(0, token=bad))
        assert reply.status == 401 and "PDFLOW_BOOTSTRAP_TOKEN" in str(reply.body)
        assert _reply(registry, RegisterDpRank(1, 0, bad)).status == 401
        for read in (QueryTopology(bad), QueryRank(0, 0, 0, 0, bad), QueryDpRanks((1,), bad)):
            reply = _reply(registry, read)
            assert reply.status == 401 and "read" in str(reply.body)
    assert registry.snapshot() == Registry().snapshot()
    assert _reply(registry, CheckHealth()) == Reply(200, "OK")
    assert _reply(registry, QueryTopology(TOKEN)) == Reply(503, NOT_READY_0)
    assert _reply(registry, rank(0, token=TOKEN)) == Reply(200, "OK")
    assert _reply(registry, RegisterDpRank(1, 0, TOKEN)) == Reply(200, "OK")
    # The secret never shows in what the registry exposes.
    assert TOKEN not in repr(registry.snapshot())


def test_without_a_token_any_token_is_accepted() -> None:
    registry = Registry()
    assert _reply(registry, rank(0, token="anything")).status == 200
    assert not registry.requires_token


def test_restarted_rank_with_new_incarnation_replaces_the_old() -> None:
    registry = Registry()
    registry.handle(rank(0, incarnation="inc-a", protocol_version=1), 0.0)
    registry.handle(rank(1, incarnation="inc-b", protocol_version=1), 0.0)
    assert _reply(registry, QueryRank(0, 0, 0, 0)).body == {
        "rank_ip": "127.0.0.1", "rank_port": 40001, "incarnation": "inc-a", "protocol_version": 1
    }
    reply = _reply(registry, rank(0, port=41001, incarnation="inc-a2", protocol_version=1))
    assert reply == Reply(200, "OK")
    assert registry.state is RegistryState.READY
    assert len(registry.snapshot().ranks) == 2
    assert _reply(registry, QueryRank(0, 0, 0, 0)).body == {
        "rank_ip": "127.0.0.1", "rank_port": 41001, "incarnation": "inc-a2", "protocol_version": 1
    }


def test_rank_answer_carries_its_staging_slot_and_the_instance_has_the_smallest() -> None:
    registry = Registry()
    registry.handle(rank(0, staging_slot_bytes=65536), 0.0)
    registry.handle(rank(1, staging_slot_bytes=16384), 0.0)
    answers = []
    for tp in (0, 1):
        body = _reply(registry, QueryRank(0, 0, tp, 0)).body
        answers.append(msgspec.convert(body, PrefillRankInfo))
    assert [a.staging_slot_bytes for a in answers] == [65536, 16384]
    assert declared_staging_slot_bytes(answers) == 16384
    # A rank that declared none (SGLang's prefill) means no small room is staged at all.
    registry.handle(rank(1), 0.0)
    body = _reply(registry, QueryRank(0, 0, 1, 0)).body
    assert isinstance(body, dict) and "staging_slot_bytes" not in body
    answers[1] = msgspec.convert(body, PrefillRankInfo)
    assert declared_staging_slot_bytes(answers) == 0
    assert declared_staging_slot_bytes([]) == 0


@pytest.mark.parametrize(
    ("system_dp_size", "attn_dp_size"),
    [(1, 2), (2, 1)],
    ids=["attention-dp-group", "system-dp-group"],
)
def test_dp_group_rule(system_dp_size: int, attn_dp_size: int) -> None:
    """dp_group is attn_dp_rank when system_dp_size == 1, else system_dp_rank."""
    registry = Registry()
    for group in range(2):
        dp_fields = (
            {"attn_dp_rank": group} if system_dp_size == 1 else {"system_dp_rank": group}
        )
        for tp in range(2):
            assert registry.state is RegistryState.COLLECTING
            registry.handle(rank(tp, port=40000 + 10 * group + tp, attn_dp_size=attn_dp_size,
                                 system_dp_size=system_dp_size, **dp_fields), 0.0)
    assert registry.state is RegistryState.READY
    body = _reply(registry, QueryTopology()).body
    assert isinstance(body, dict) and body["dp_size"] == 2
    assert _reply(registry, QueryRank(1, 0, 1, 0)).body == {
        "rank_ip": "127.0.0.1", "rank_port": 40011
    }


def test_cp_and_pp_ranks_all_count() -> None:
    registry = Registry()
    keys = [(cp, pp) for cp in range(2) for pp in range(3)]
    for index, (cp, pp) in enumerate(keys):
        assert registry.state is RegistryState.COLLECTING
        registry.handle(rank(0, tp_size=1, attn_cp_size=2, attn_cp_rank=cp, pp_size=3,
                             pp_rank=pp, port=40100 + index), 0.0)
    assert registry.state is RegistryState.READY
    assert _reply(registry, QueryRank(0, 1, 0, 2)).body == {
        "rank_ip": "127.0.0.1", "rank_port": 40105
    }


def test_room_dp_ranks_expire_exactly_after_the_ttl() -> None:
    registry = Registry(dp_rank_ttl=120.0)
    assert registry.timer_at() is None
    assert _reply(registry, RegisterDpRank(123456789, 0), now=10.0) == Reply(200, "OK")
    assert registry.timer_at() == 130.0
    query = QueryDpRanks((123456789, 42))
    assert _reply(registry, query, now=129.9) == Reply(200, {"123456789": 0})
    # Expired answers are never given, whether or not a Tick has purged them yet.
    assert _reply(registry, query, now=130.0) == Reply(200, {})
    registry.handle(Tick(), 129.0)
    assert len(registry.snapshot().room_dp_ranks) == 1
    registry.handle(Tick(), 130.0)
    assert registry.snapshot().room_dp_ranks == ()
    assert registry.timer_at() is None


def test_reregistering_a_room_refreshes_its_entry() -> None:
    registry = Registry(dp_rank_ttl=10.0)
    registry.handle(RegisterDpRank(1, 0), 0.0)
    registry.handle(RegisterDpRank(2, 0), 5.0)
    registry.handle(RegisterDpRank(1, 1), 8.0)
    assert registry.timer_at() == 15.0  # room 2 is now the oldest
    registry.handle(Tick(), 16.0)
    assert _reply(registry, QueryDpRanks((1, 2)), now=16.0) == Reply(200, {"1": 1})


def test_dp_rank_registration_is_checked() -> None:
    registry = registry_in(_R)  # dp_size 1
    assert "dp_rank=1 must be below" in str(_reply(registry, RegisterDpRank(5, 1)).body)
    assert "dp_rank=-1" in str(_reply(registry, RegisterDpRank(5, -1)).body)
    assert "bootstrap_room=-5" in str(_reply(registry, RegisterDpRank(-5, 0)).body)
    assert registry.snapshot().room_dp_ranks == ()
    # Before any rank registered, the dp size is unknown: any dp rank >= 0 is taken.
    assert _reply(Registry(), RegisterDpRank(5, 3)).status == 200


def test_a_dp_rank_taken_before_the_dp_size_was_known_is_dropped_once_it_is() -> None:
    """Before: room 5 -> dp rank 7 stayed answered after a dp_size=2 prefill registered."""
    registry = Registry()
    assert _reply(registry, RegisterDpRank(5, 7)) == Reply(200, "OK")
    assert _reply(registry, RegisterDpRank(6, 1)) == Reply(200, "OK")
    registry.handle(rank(0, tp_size=1, attn_dp_size=2), 1.0)
    assert _reply(registry, QueryDpRanks((5, 6))) == Reply(200, {"6": 1})
    assert [room for room, _, _ in registry.snapshot().room_dp_ranks] == [6]


def test_route_query_sentinel() -> None:
    assert route_query(-1, -1, -1, -1) == QueryTopology()
    assert route_query(-1, -1, -1, 0) == QueryRank(-1, -1, -1, 0)
    assert _reply(registry_in(_R), route_query(-1, 0, 0, 0)).status == 404


def test_tick_is_not_a_request() -> None:
    with pytest.raises(ValueError, match="no reply"):
        Registry().reply_to(Tick(), 0.0)


def test_constructor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        Registry(token="")
    with pytest.raises(ValueError, match="dp_rank_ttl"):
        Registry(dp_rank_ttl=0.0)


# ---- finding 4: registrations are ordered -------------------------------------------------
def _lives(registry: Registry, incarnation: str, started_at: float | None, port: int) -> None:
    for tp in (0, 1):
        ordered = {} if started_at is None else {"started_at": started_at}
        reply = _reply(registry, rank(tp, port=port + tp, incarnation=incarnation, **ordered))
        assert reply == Reply(200, "OK"), reply


def test_finding4_late_put_from_a_dead_incarnation_gets_409_and_changes_nothing() -> None:
    """Issue 12, finding 4: a dead incarnation's late PUT used to get 200 and take its ranks
    back from the live one (the decode then sent its metadata to the dead process). Refused by
    arrival alone: the registry remembers whom a newer life replaced."""
    registry = Registry()
    _lives(registry, "p-dead", None, 40001)
    _lives(registry, "p-live", None, 41001)
    before = registry.snapshot()
    late = _reply(registry, rank(0, port=40001, incarnation="p-dead"))
    assert late.status == 409, late
    assert before.superseded == ("p-dead",)
    assert isinstance(late.body, str) and late.body.startswith("Superseded registration")
    assert "p-dead" in late.body and "must stop" in late.body
    assert registry.snapshot() == before
    assert _reply(registry, QueryRank(0, 0, 0, 0)).body == {
        "rank_ip": "127.0.0.1", "rank_port": 41001, "incarnation": "p-live",
    }


def test_an_older_first_registration_of_a_rank_gets_409() -> None:
    """Ordered by start time, not by arrival: a PUT of an older life that never registered
    before (its first attempt was delayed past the restart) is refused too."""
    registry = Registry()
    assert _reply(registry, rank(0, incarnation="p-new", started_at=20.0)).status == 200
    before = registry.snapshot()
    late = _reply(registry, rank(0, port=40009, incarnation="p-old", started_at=10.0))
    assert late.status == 409 and "is older than incarnation p-new" in str(late.body)
    assert registry.snapshot() == before
    # A newer life still replaces it, and a retried PUT of the live one stays accepted.
    assert _reply(registry, rank(0, incarnation="p-newer", started_at=30.0)).status == 200
    assert _reply(registry, rank(0, incarnation="p-newer", started_at=30.0)).status == 200
    assert registry.snapshot().superseded == ("p-new",)


def test_a_superseded_incarnation_is_refused_on_every_rank() -> None:
    registry = Registry()
    _lives(registry, "p-a", 1.0, 40001)
    assert _reply(registry, rank(0, port=41001, incarnation="p-b", started_at=2.0)).status == 200
    # Rank 1 is still p-a's, but p-a is a finished process life: its PUTs are all refused.
    assert _reply(registry, rank(1, incarnation="p-a", started_at=1.0)).status == 409
    assert _reply(registry, rank(1, port=41002, incarnation="p-b", started_at=2.0)).status == 200


def test_the_superseded_memory_is_bounded() -> None:
    """Before: every life that ever held a rank was kept, so 1,000 PUTs of 60 KB incarnations
    grew the registry by 57 MiB."""
    registry = Registry()
    for life in range(10 * SUPERSEDED_MEMORY):
        reply = _reply(registry, rank(0, tp_size=1, incarnation=f"p-{life}",
                                      started_at=float(life)))
        assert reply == Reply(200, "OK")
    assert len(registry.superseded) == SUPERSEDED_MEMORY
    # The most recent dead lives are still refused by arrival alone (no start time)...
    last_dead = f"p-{10 * SUPERSEDED_MEMORY - 2}"
    assert _reply(registry, rank(0, tp_size=1, incarnation=last_dead)).status == 409
    # ... and a forgotten one by its start time: it is older than the life holding the rank.
    late = _reply(registry, rank(0, tp_size=1, incarnation="p-0", started_at=0.0))
    assert late.status == 409 and "is older than" in str(late.body)


def test_a_dead_life_still_holding_a_rank_is_never_forgotten() -> None:
    registry = Registry()
    _lives(registry, "p-old", 1.0, 40001)
    assert _reply(registry, rank(0, incarnation="p-0", started_at=2.0)).status == 200
    for life in range(1, 3 * SUPERSEDED_MEMORY):  # rank 0 changes hands; rank 1 stays p-old's
        reply = _reply(registry, rank(0, incarnation=f"p-{life}", started_at=2.0 + life))
        assert reply.status == 200, reply
    assert "p-old" in registry.superseded
    assert len(registry.superseded) <= SUPERSEDED_MEMORY + len(registry.ranks)
    assert _reply(registry, rank(1, incarnation="p-old")).status == 409


def _restart(registry: Registry, incarnation: str, started_at: float, **changed: Any) -> None:
    for tp in (0, 1):
        reply = _reply(registry, rank(tp, port=42001 + tp, incarnation=incarnation,
                                      started_at=started_at, **changed))
        assert reply == Reply(200, "OK"), reply


def test_a_restarted_prefill_is_answered_with_its_new_settings() -> None:
    """Before: the topology stayed the dead life's first registration (its HTTP port, its load
    balance method), and a restart with another page size or protocol version got 400 for
    ever."""
    registry = Registry()
    _restart(registry, "p-a", 100.0, protocol_version=3)
    changed: dict[str, Any] = {
        "prefill_http_port": 31000, "load_balance_method": "round_robin",
        "enable_kv_cache_sharding": True, "page_size": 32, "protocol_version": 4,
        "kv_cache_dtype": "fp8_e4m3", "checksum": True,
    }
    _restart(registry, "p-b", 200.0, **changed)
    body = _reply(registry, QueryTopology()).body
    assert isinstance(body, dict)
    assert (body["prefill_http_port"], body["follow_bootstrap_room"], body["page_size"],
            body["enable_kv_cache_sharding"], body["kv_cache_dtype"]) == (
        31000, False, 32, True, "fp8_e4m3")
    first = registry.snapshot().first
    assert first is not None and first.incarnation == "p-b" and first.protocol_version == 4
    # The dead life cannot come back, and its settings bind no one any more.
    assert _reply(registry, rank(0, incarnation="p-a", protocol_version=3)).status == 409


def test_a_new_life_must_agree_with_the_live_ranks_it_does_not_replace() -> None:
    """dp group 1 restarts with another page size while dp group 0 still runs the old one: the
    instance would mix page sizes, so the registration is refused, saying what to do."""
    registry = Registry()
    for dp, life in ((0, "p-dp0"), (1, "p-dp1")):
        reply = _reply(registry, rank(0, tp_size=1, attn_dp_size=2, attn_dp_rank=dp,
                                      incarnation=life, started_at=10.0))
        assert reply.status == 200
    before = registry.snapshot()
    mixed = _reply(registry, rank(0, tp_size=1, attn_dp_size=2, attn_dp_rank=1, page_size=32,
                                  incarnation="p-dp1b", started_at=20.0))
    assert mixed.status == 400 and "of live prefill rank dp=0 cp=0 tp=0 pp=0" in str(mixed.body)
    assert "restart the whole instance" in str(mixed.body)
    assert registry.snapshot() == before
    # The parallel sizes never change while the registry runs, whoever restarts.
    sizes = _reply(registry, rank(0, tp_size=1, attn_dp_size=1, incarnation="p-dp0b",
                                  started_at=20.0))
    assert sizes.status == 400 and "restart the registry" in str(sizes.body)


def test_a_lone_rank_reregistering_with_new_settings_updates_the_topology() -> None:
    registry = Registry()
    assert _reply(registry, rank(0, tp_size=1)) == Reply(200, "OK")
    assert _reply(registry, rank(0, tp_size=1, prefill_http_port=31000)) == Reply(200, "OK")
    body = _reply(registry, QueryTopology()).body
    assert isinstance(body, dict) and body["prefill_http_port"] == 31000


def test_sglang_registrations_without_order_still_replace_their_rank() -> None:
    registry = Registry()
    assert _reply(registry, rank(0, incarnation="p-a", started_at=5.0)).status == 200
    assert _reply(registry, rank(0, port=40009)).status == 200  # SGLang: no incarnation
    assert _reply(registry, QueryRank(0, 0, 0, 0)).status == 503  # not ready, but replaced
    assert registry.ranks[(0, 0, 0, 0)].rank_port == 40009
    assert registry.snapshot().superseded == ()


def test_the_same_life_registers_again_after_a_restart_and_while_registered() -> None:
    """Chaos finding 2: a prefill re-registers its ranks with a restarted (empty) registry, and
    re-registering while still held must stay harmless: one life is never its own successor."""
    live = Registry()
    _lives(live, "p-a", 5.0, 40001)
    again = _reply(live, rank(0, port=40001, incarnation="p-a", started_at=5.0))
    assert again.status == 200 and live.snapshot().superseded == ()
    restarted = Registry()  # a new registry process: nothing of the old one survives
    _lives(restarted, "p-a", 5.0, 40001)
    assert restarted.state.name == "READY" and restarted.snapshot().superseded == ()
    assert _reply(restarted, QueryRank(0, 0, 0, 0)).body == {
        "rank_ip": "127.0.0.1", "rank_port": 40001, "incarnation": "p-a", "started_at": 5.0,
    }
