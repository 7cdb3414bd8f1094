"""Checks an HTTP JSON body passes before it is decoded: its media type and its nesting depth.

msgspec decodes nested JSON recursively, so a 40 KB body of brackets raised ``RecursionError``
(HTTP 500, and uvicorn closed the keep-alive connection). :func:`nesting_depth` reads the
structure in one linear pass over the brackets, quotes and backslashes only, and stops as soon
as the limit is passed.
"""

from __future__ import annotations

import re

MAX_JSON_DEPTH = 32
"""Deepest nesting a request body may have; SGLang's bodies nest at most 3 deep."""

JSON_MEDIA_TYPE = "application/json"

_STRUCTURE = re.compile(rb'[\[\]{}"\\]')
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = frozenset(b"[{"), frozenset(b"]}"), ord('"'), ord("\\")


def is_json(content_type: str | None) -> bool:
    """``application/json``, any case, parameters (``; charset=utf-8``) allowed."""
    if content_type is None:
        return False
    return content_type.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def nesting_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``body`` nests arrays and objects, counting at most to ``limit + 1``.

    Brackets inside strings do not count; the body need not be valid JSON (the decoder says
    what else is wrong with it)."""
    depth = deepest = 0
    in_string = False
    escaped_at = -1
    for match in _STRUCTURE.finditer(body):
        at = match.start()
        if at == escaped_at:
            continue
        char = body[at]
        if in_string:
            if char == _BACKSLASH:
                escaped_at = at + 1
            elif char == _QUOTE:
                in_string = False
        elif char == _QUOTE:
            in_string = True
        elif char in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif char in _CLOSE and depth:  # stray closers never buy depth for later openers
            depth -= 1
    return deepest
