"""Registry fuzzer: hostile HTTP requests at a running bootstrap server that requires the token,
over one keep-alive connection. ``PDFLOW_FUZZ_EXAMPLES`` sets the budget when given; without it
this fuzzer runs ``REGISTRY_CI_EXAMPLES`` (each request also reads the registry twice, so the
codec fuzzers' default of 5,000 would cost CI about three minutes here).

About half the requests carry the valid token, so they reach the registry's validation (the
pdflow fields too: health, incarnation, started_at, ports, ...), with text drawn from all of
Unicode; the others carry none or a wrong one. No request gets a 500. None without the token
changes the registry, and on a guarded route it gets 401 whatever else is wrong. Afterwards
every held registration is well-formed, the registry's memory of dead lives is bounded, it
still answers with the token, and the process grew by at most FD_BOUND descriptors and
RSS_BOUND bytes. With the ASCII-digit check of ``health`` reverted this fuzzer gets a 500
(``int('⓵')``) within its CI budget."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import anyio.from_thread
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflow.core.cluster.registry import SUPERSEDED_MEMORY, _malformation
from pdflow.io.bootstrap_server import ROUTE_QUERY, serve
from tests.integration.test_bootstrap_http import rank_path, sglang_body
from tests.integration.test_fuzz_node import open_fds
from tests.integration.test_hostile_input import rss_bytes
from tests.property.frame_strategies import FUZZ_EXAMPLES, errors_only, fuzz_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOKEN = "fuzz-registry-token"
REGISTRY_CI_EXAMPLES = 2000
EXAMPLES = FUZZ_EXAMPLES if "PDFLOW_FUZZ_EXAMPLES" in os.environ else REGISTRY_CI_EXAMPLES
ANSWERS = {200, 307, 400, 401, 404, 405, 413, 415, 503}
"""Every status the server may give a request without the token (200: /health; 307: Starlette
redirects a trailing slash)."""
AUTHORIZED_ANSWERS = {200, 307, 400, 404, 405, 409, 413, 415, 503}
"""And with it: 409 for a superseded life, never 401."""
FD_BOUND = 8
RSS_BOUND = 32 << 20

_ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24)
# Any Unicode but lone surrogates (JSON cannot carry them): other scripts' digits, '²', ...
_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=24)
_DIGITS = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=6)
# What httpx lets into a URL path (it refuses control characters before sending).
_PATH_TEXT = st.text(st.characters(exclude_categories=["Cs", "Cc"]), max_size=24)
# h11 refuses header values with surrounding blanks before they leave the client.
_HEADER_TEXT = _ASCII.map(str.strip)
_NUMBER = st.integers(-(2**64), 2**64) | st.floats(allow_nan=False, allow_infinity=False)
_JSON = st.recursive(
    st.none() | st.booleans() | _NUMBER | _ASCII | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=10,
)
_PORTS = st.integers(-1, 70_000) | st.just(65_535) | st.just(2**63 - 1)
_HOST_PORT = st.one_of(
    st.just("127.0.0.1:9000"),
    st.builds("{}:{}".format, _ASCII | _TEXT, _DIGITS),  # '²', Arabic-Indic digits, ...
    st.builds("{}:{}".format, st.just("h"), _DIGITS),
    st.builds("{}:{}".format, _ASCII, _PORTS),
    _TEXT,
)
_INCARNATION = st.one_of(
    st.sampled_from(["p-a", "p-b", "p-c"]),
    _TEXT,
    st.integers(100, 300).map(lambda n: "p" * n),
)
_STARTED_AT = st.one_of(
    st.floats(0, 2e9), st.just(1e300), st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**64), 2**64),
)

# pdflow's own fields of a registration, and SGLang's optional ones, each with hostile values.
_PDFLOW_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "health": _HOST_PORT,
    "incarnation": _INCARNATION,
    "started_at": _STARTED_AT,
    "protocol_version": st.integers(-2, 5),
    "checksum": st.booleans() | st.none(),
    "is_mla": st.booleans() | st.none(),
    "staging_slot_bytes": st.integers(-(2**63), 2**64),
    "prefill_http_port": _PORTS,
    "load_balance_method": st.sampled_from(["follow_bootstrap_room", "round_robin"]) | _TEXT,
    "enable_dsa_cache_layer_split": st.booleans(),
    "enable_kv_cache_sharding": st.booleans(),
    "rank_ip": _TEXT,
    "kv_cache_dtype": st.sampled_from(["auto", "fp8_e4m3"]) | _TEXT,
    "received_at": _STARTED_AT,  # the server's to stamp: a body's value is ignored
}


@st.composite
def _registration(draw: st.DrawFn) -> dict[str, Any]:
    """A registration as SGLang or pdflow sends it, one to three of pdflow's (or SGLang's
    optional) fields drawn hostile, so most get past the other checks to the drawn one's."""
    tp = draw(st.integers(0, 1))
    body = sglang_body(tp, draw(st.sampled_from([40001 + tp, 41001 + tp])))
    if draw(st.booleans()):  # as pdflow's prefill sends it
        body |= {"incarnation": draw(st.sampled_from(["p-a", "p-b", "p-c"])),
                 "started_at": draw(st.sampled_from([1.7e9, 1.7e9 + 1, 1.7e9 + 2])),
                 "protocol_version": 1, "health": "127.0.0.1:9000"}
    for name in draw(st.lists(st.sampled_from(sorted(_PDFLOW_FIELDS)), min_size=1, max_size=3,
                              unique=True)):  # fmt: skip
        body[name] = draw(_PDFLOW_FIELDS[name])
    return body


@st.composite
def _sglang_like(draw: st.DrawFn) -> bytes:
    """A registration or dp-rank body, with fields changed or dropped."""
    body: dict[str, Any] = draw(st.sampled_from([
        sglang_body(0, 40001), {"bootstrap_room": 1, "dp_rank": 0}, {"bootstrap_rooms": [1, 2]},
    ]))  # fmt: skip
    if "attn_tp_size" in body and draw(st.booleans()):
        body = draw(_registration())
    body = dict(body)
    for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=3)):
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(_JSON)
    return json.dumps(body).encode()


_BODIES = st.one_of(
    st.just(b""),
    _sglang_like(),
    _sglang_like(),
    _registration().map(lambda body: json.dumps(body).encode()),
    _JSON.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=64),
    st.builds(lambda n, open_, close: open_ * n + close * n, st.integers(1, 30_000),
              st.sampled_from([b"[", b'{"a":']), st.sampled_from([b"]", b"}"])),
)  # fmt: skip

_ROUTES = {"/route": ["GET", "PUT"], "/register_dp_rank": ["POST"], "/query_dp_ranks": ["POST"],
           "/health": ["GET"]}
_METHODS = ["GET", "PUT", "POST", "DELETE", "PATCH", "OPTIONS", "HEAD"]
_ODD_PATHS = ["/", "/nope", "/route/", "/ROUTE", "/health/x", "/%00", "//route"]


@st.composite
def _method_and_path(draw: st.DrawFn) -> tuple[str, str]:
    """Mostly SGLang's routes with their own methods, sometimes anything anywhere."""
    kind = draw(st.integers(0, 9))
    if kind < 6:
        path = draw(st.sampled_from(sorted(_ROUTES)))
        return draw(st.sampled_from(_ROUTES[path])), path
    if kind < 8:
        return draw(st.sampled_from(_METHODS)), draw(st.sampled_from(sorted(_ROUTES)))
    path = draw(st.sampled_from(_ODD_PATHS) | (_ASCII | _PATH_TEXT).map(lambda t: "/" + t))
    return draw(st.sampled_from(_METHODS)), path


_QUERY = st.one_of(
    st.fixed_dictionaries({name: st.integers(-2, 3).map(str) for name in ROUTE_QUERY}),
    st.dictionaries(st.sampled_from([*ROUTE_QUERY, "x", ""]),
                    st.one_of(st.integers(-(2**70), 2**70).map(str), _ASCII, _DIGITS, _TEXT),
                    max_size=5),
)  # fmt: skip
_JSON_TYPES = st.sampled_from(["application/json", "application/json; charset=utf-8",
                               "APPLICATION/JSON"])  # fmt: skip

_HEADERS = st.fixed_dictionaries({
    "Content-Type": st.one_of(_JSON_TYPES, _JSON_TYPES, _JSON_TYPES, st.sampled_from(
        ["text/plain", "application/x-www-form-urlencoded", "", "application/jsonx"]),
        _HEADER_TEXT),
}, optional={
    "Authorization": st.sampled_from(["Bearer wrong", "Basic " + TOKEN, "Bearer", ""])
    | _HEADER_TEXT,
    "X-Pdflow-Token": st.sampled_from(["", "wrong", TOKEN + "x"]) | _HEADER_TEXT,
})  # fmt: skip


_GUARDED = {("GET", "/route"), ("PUT", "/route"), ("POST", "/register_dp_rank"),
            ("POST", "/query_dp_ranks")}

REQUESTS = st.one_of(
    st.tuples(st.booleans(), _method_and_path(), _QUERY, _HEADERS, _BODIES),
    # Registrations, mostly with the token: the registry's validation is the target.
    st.tuples(st.sampled_from([True, True, True, False]), st.just(("PUT", "/route")),
              st.just({}), st.just({"Content-Type": "application/json"}),
              _registration().map(lambda body: json.dumps(body).encode())),
)
"""(with the valid token?, (method, path), query, headers, body)."""


def test_fuzzed_requests_get_no_500_and_only_authorized_ones_change_anything() -> None:
    with (
        anyio.from_thread.start_blocking_portal("asyncio") as portal,
        # The room -> dp rank entry must not expire while the fuzzer runs: that would be a change.
        portal.wrap_async_context_manager(serve("127.0.0.1", 0, token=TOKEN,
                                                dp_rank_ttl=1e9)) as server,
    ):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            for tp in (0, 1):
                response = http.put("/route", json=sglang_body(tp, 40001 + tp), headers=auth)
                assert response.status_code == 200, response.text
            assert http.post("/register_dp_rank", json={"bootstrap_room": 5, "dp_rank": 0},
                             headers=auth).status_code == 200  # fmt: skip
        registry = server.registry
        statuses: dict[tuple[bool, int], int] = {}
        dry = True  # the first pass only generates: Hypothesis's own caches are not the server's

        @fuzz_settings(EXAMPLES)
        @given(REQUESTS)
        def request(case: tuple[bool, tuple[str, str], dict[str, str], dict[str, str],
                                bytes]) -> None:  # fmt: skip
            if dry:
                return
            authorized, (method, path), query, headers, body = case
            if authorized:
                headers = {**headers, "X-Pdflow-Token": TOKEN}
            else:
                before = portal.call(registry.snapshot)
            response = http.request(method, path, params=query, headers=headers, content=body)
            allowed = AUTHORIZED_ANSWERS if authorized else ANSWERS
            assert response.status_code in allowed, (case, response.status_code, response.text)
            if not authorized:
                assert portal.call(registry.snapshot) == before, (case, response.text)
                if (method, path) in _GUARDED:  # the token is checked before anything else
                    assert response.status_code == 401, (case, response.text)
            key = (authorized, response.status_code)
            statuses[key] = statuses.get(key, 0) + 1

        request()
        dry = False
        fds, rss = open_fds(), rss_bytes()
        with errors_only(), httpx.Client(base_url=server.url, timeout=10.0) as http:
            request()
        after = portal.call(registry.snapshot)
        for _, held in after.registrations:  # whatever the fuzzer got accepted is well-formed
            assert _malformation(held) is None, held
            if held.started_at is not None:
                assert math.isfinite(held.started_at) and held.started_at < 1e10, held
        assert len(after.superseded) <= SUPERSEDED_MEMORY + len(after.ranks)
        assert all(dp == 0 for _, dp, _ in after.room_dp_ranks), "dp_size is 1"
        with httpx.Client(base_url=server.url, timeout=10.0, headers=auth) as http:
            assert http.get("/health").status_code == 200
            assert http.get(rank_path(0, 0, 1, 0)).status_code in (200, 404)
            assert http.post("/query_dp_ranks", json={"bootstrap_rooms": [5]}).status_code == 200
        assert open_fds() - fds <= FD_BOUND
        assert rss_bytes() - rss <= RSS_BOUND, f"RSS grew {(rss_bytes() - rss) >> 20} MiB"
        assert sum(statuses.values()) == EXAMPLES
        accepted = statuses.get((True, 200), 0)
        assert accepted and statuses.get((True, 400), 0), "the token must reach validation"
        print(f"fuzzed {EXAMPLES} requests: {dict(sorted(statuses.items()))}")
