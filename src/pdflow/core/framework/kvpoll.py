"""KVPoll: the per-room status every engine polls. The integer values are wire-visible."""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


# Read on every step: a member read off its class costs ~0.1 us on Python 3.11 (EnumType's
# __getattr__ puts every class attribute lookup through a slower slot), a module global does not.
_TERMINAL = (KVPoll.Failed, KVPoll.Success)


def poll_may_follow(before: KVPoll, after: KVPoll) -> bool:
    """The monotonicity rule: progress only forward, Failed reachable from anywhere and absorbing,
    Success sticky."""
    if before is KVPoll.Failed:
        return after is KVPoll.Failed
    if before is KVPoll.Success:
        return after is KVPoll.Success
    return after is KVPoll.Failed or after >= before


def merge_polls(polls: list[KVPoll]) -> KVPoll:
    """Cross-rank consensus: schedulers act on the minimum of all ranks' polls."""
    if not polls:
        raise ValueError("merge_polls needs at least one poll value")
    return KVPoll(min(polls))
