"""Registry fuzzer: ``PDFLOW_FUZZ_EXAMPLES`` hostile HTTP requests (5,000 in CI) at a running
bootstrap server that requires the token, over one keep-alive connection.

No request gets a 500; none carries the token, so none may change the registry; afterwards a
request with the token still gets the right answer, and the process grew by at most FD_BOUND
descriptors and RSS_BOUND bytes."""

from __future__ import annotations

import json
from typing import Any

import anyio.from_thread
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflow.io.bootstrap_server import ROUTE_QUERY, serve
from tests.integration.test_bootstrap_http import rank_path, sglang_body
from tests.integration.test_fuzz_node import open_fds
from tests.integration.test_hostile_input import rss_bytes
from tests.property.frame_strategies import FUZZ_EXAMPLES, errors_only, fuzz_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOKEN = "fuzz-registry-token"
ANSWERS = {200, 307, 400, 401, 404, 405, 413, 415, 503}
"""Every status the server may give a request without the token (200: /health; 307: Starlette
redirects a trailing slash)."""
FD_BOUND = 8
RSS_BOUND = 32 << 20

_ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=24)
# h11 refuses header values with surrounding blanks before they leave the client.
_HEADER_TEXT = _ASCII.map(str.strip)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _ASCII,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_ASCII, inner, max_size=4),
    max_leaves=10,
)


@st.composite
def _sglang_like(draw: st.DrawFn) -> bytes:
    """A registration or dp-rank body as SGLang sends it, with fields changed or dropped."""
    body: dict[str, Any] = draw(st.sampled_from([
        sglang_body(0, 40001), {"bootstrap_room": 1, "dp_rank": 0}, {"bootstrap_rooms": [1, 2]},
    ]))  # fmt: skip
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
    path = draw(st.sampled_from(_ODD_PATHS) | _ASCII.map(lambda text: "/" + text))
    return draw(st.sampled_from(_METHODS)), path


_QUERY = st.one_of(
    st.fixed_dictionaries({name: st.integers(-2, 3).map(str) for name in ROUTE_QUERY}),
    st.dictionaries(st.sampled_from([*ROUTE_QUERY, "x", ""]),
                    st.one_of(st.integers(-(2**70), 2**70).map(str), _ASCII), max_size=5),
)  # fmt: skip
_JSON_TYPES = st.sampled_from(["application/json", "application/json; charset=utf-8",
                               "APPLICATION/JSON"])  # fmt: skip

_HEADERS = st.fixed_dictionaries({
    "Content-Type": st.one_of(_JSON_TYPES, _JSON_TYPES, st.sampled_from(
        ["text/plain", "application/x-www-form-urlencoded", "", "application/jsonx"]),
        _HEADER_TEXT),
}, optional={
    "Authorization": st.sampled_from(["Bearer wrong", "Basic " + TOKEN, "Bearer", ""])
    | _HEADER_TEXT,
    "X-Pdflow-Token": st.sampled_from(["", "wrong", TOKEN + "x"]) | _HEADER_TEXT,
})  # fmt: skip


REQUESTS = st.tuples(_method_and_path(), _QUERY, _HEADERS, _BODIES)


def test_fuzzed_requests_get_no_500_and_change_nothing() -> None:
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
        before = portal.call(registry.snapshot)
        statuses: dict[int, int] = {}
        dry = True  # the first pass only generates: Hypothesis's own caches are not the server's

        @fuzz_settings()
        @given(REQUESTS)
        def request(case: tuple[tuple[str, str], dict[str, str], dict[str, str], bytes]) -> None:
            if dry:
                return
            (method, path), query, headers, body = case
            response = http.request(method, path, params=query, headers=headers, content=body)
            assert response.status_code in ANSWERS, (case, response.status_code, response.text)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        request()
        dry = False
        fds, rss = open_fds(), rss_bytes()
        with errors_only(), httpx.Client(base_url=server.url, timeout=10.0) as http:
            request()
        assert portal.call(registry.snapshot) == before
        with httpx.Client(base_url=server.url, timeout=10.0, headers=auth) as http:
            assert http.get(rank_path(0, 0, 1, 0)).json()["rank_port"] == 40002
            assert http.post("/query_dp_ranks", json={"bootstrap_rooms": [5]}).json() == {"5": 0}
        assert open_fds() - fds <= FD_BOUND
        assert rss_bytes() - rss <= RSS_BOUND, f"RSS grew {(rss_bytes() - rss) >> 20} MiB"
        assert sum(statuses.values()) == FUZZ_EXAMPLES
        print(f"fuzzed {FUZZ_EXAMPLES} requests: {dict(sorted(statuses.items()))}")
