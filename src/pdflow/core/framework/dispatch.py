"""Dispatch on an input's type without an isinstance call per branch tried.

Hot paths compare ``type(inp)`` with ``is`` (an isinstance call per branch cost more than the
rest of the branch); these helpers send a subclass of a listed type where isinstance would.
"""

from __future__ import annotations


def listed_kind(inp: object, kinds: frozenset[type]) -> type:
    """The type to dispatch ``inp`` on: the listed type it is an instance of, else its own
    (listed types are unrelated, so at most one matches). Called only for unlisted types."""
    for kind in kinds:
        if isinstance(inp, kind):
            return kind
    return type(inp)


def remembered_kind(inp: object, listed: frozenset[type], seen: dict[type, type]) -> type:
    """``listed_kind``, remembered for the class in ``seen`` (one dict per call site, one entry
    per class ever passed: what isinstance decides depends only on the class). Callers read
    ``seen.get(type(inp))`` themselves and call this on a miss."""
    kind = seen[type(inp)] = listed_kind(inp, listed)
    return kind
