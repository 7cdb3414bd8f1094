"""The JSON body checks the bootstrap server runs before decoding."""

from __future__ import annotations

import json

import pytest

from pdflow.io.json_guard import MAX_JSON_DEPTH, is_json, nesting_depth


@pytest.mark.parametrize(
    ("body", "depth"),
    [
        (b"", 0),
        (b"42", 0),
        (b"{}", 1),
        (b'{"a": [1, {"b": [2]}]}', 4),
        (b'{"a": "[[[[{{{{"}', 1),
        (b'{"a": "quote \\" then [[[["}', 1),
        (b'{"a": "backslash \\\\"}, [[1]]', 2),
        (b'["\\\\\\"[[["]', 1),
        (b"]]]][[", 2),
    ],
)
def test_nesting_depth_counts_structure_not_string_contents(body: bytes, depth: int) -> None:
    assert nesting_depth(body) == depth


def test_nesting_depth_agrees_with_json_and_stops_past_the_limit() -> None:
    nested: object = 1
    for level in range(1, 60):
        nested = [nested] if level % 2 else {"k\\\"[": nested}
        assert nesting_depth(json.dumps(nested).encode()) == min(level, MAX_JSON_DEPTH + 1)
    assert nesting_depth(b"[" * 100_000) == MAX_JSON_DEPTH + 1


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        (" application/json ;charset=UTF-8", True),
        (None, False),
        ("", False),
        ("text/plain", False),
        ("application/jsonx", False),
        ("application/x-www-form-urlencoded", False),
    ],
)
def test_only_json_media_types_pass(header: str | None, ok: bool) -> None:
    assert is_json(header) is ok
