"""The shell's resource bounds: what a node holds for its peers, capped per peer and in total.

Each bound is a setting (see docs/operations.md for the defaults and how they were sized): past
one, the node closes the least recently used entry or refuses the new one, counts it by reason,
and keeps serving. What the *core* keeps (per room id, and the KV layouts decode ranks announced,
``control_max_peers`` of at most ``control_max_layout_bytes`` each) is bounded by the core itself.

- :class:`SocketPool`: the outgoing PUSH sockets of all the control channels of one node; the
  least recently used one is closed when a new peer needs a socket past ``limit``.
- :class:`EarlyPages`: destination pages of RoomMetadata that arrived for a room the prefill
  rank has not opened yet (the core parks it until the room opens or ``bootstrap_timeout``);
  at most ``limit`` pages are admitted that way per rank, and at most ``per_decode`` of them
  (a quarter unless set) for any one decode life, so one decode cannot use up the budget the
  others need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from pdflow.core.protocol.messages import Abort, BootstrapRequest, KvArgs, PeerId, RoomMetadata

K = TypeVar("K")
V = TypeVar("V")


class _Lru(Generic[K, V]):
    """An ordered map that evicts its least recently used entry past ``limit``."""

    def __init__(self, limit: int, evicted: Callable[[K, V], None]) -> None:
        if limit < 1:
            raise ValueError(f"a limit must be at least 1, got {limit}")
        self.limit = limit
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._evicted = evicted

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._entries.pop(key, None)
        while len(self._entries) >= self.limit:
            old_key, old_value = self._entries.popitem(last=False)
            self._evicted(old_key, old_value)
        self._entries[key] = value

    def pop(self, key: K) -> V | None:
        return self._entries.pop(key, None)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


class Closable(Protocol):
    def close(self, linger: int | None = None) -> None: ...


S = TypeVar("S", bound=Closable)


class SocketPool(Generic[S]):
    """Outgoing sockets keyed by (owner, address); closing the least recently used past
    ``limit`` loses what was queued on it (the core's timers cover lost messages)."""

    def __init__(self, limit: int, on_evict: Callable[[], None] = lambda: None) -> None:
        self._on_evict = on_evict
        self._sockets: _Lru[tuple[int, str], S] = _Lru(limit, self._close)

    @property
    def limit(self) -> int:
        return self._sockets.limit

    def _close(self, key: tuple[int, str], sock: S) -> None:
        sock.close(linger=0)
        self._on_evict()

    def get(self, owner: int, address: str) -> S | None:
        return self._sockets.get((owner, address))

    def put(self, owner: int, address: str, sock: S) -> None:
        self._sockets.put((owner, address), sock)

    def pop(self, owner: int, address: str) -> S | None:
        return self._sockets.pop((owner, address))

    def addresses(self, owner: int) -> tuple[str, ...]:
        return tuple(address for key_owner, address in self._sockets if key_owner == owner)

    def __len__(self) -> int:
        return len(self._sockets)


EARLY_SHARES = 4
"""Unless set otherwise, one decode life may hold 1/EARLY_SHARES of a rank's early pages: it
takes that many decode lives to use the budget up."""


class EarlyPages:
    """Pages admitted for rooms not open yet, each released when its room opens or at
    ``expires_at`` (the core has discarded what it parked by then): at most ``limit`` in all,
    and at most ``per_decode`` from any one decode life."""

    def __init__(self, limit: int, hold_s: float, per_decode: int | None = None) -> None:
        share = max(1, limit // EARLY_SHARES) if per_decode is None else per_decode
        if min(limit, share) < 1:
            raise ValueError(f"the early page limits must be at least 1, got {limit} and {share}")
        self.limit = limit
        self.per_decode = share
        self.hold_s = hold_s
        self.pages = 0
        self._by_decode: dict[PeerId, int] = {}
        # Per room, the pages each decode life holds there. Insertion order is arrival order
        # and every hold is equally long: expiry pops from the front.
        self._rooms: OrderedDict[int, tuple[dict[PeerId, int], float]] = OrderedDict()

    def admit(self, room: int, decode: PeerId, pages: int, now: float) -> str | None:
        """None if admitted, else why not: ``early_pages_limit`` (the rank's budget is used up)
        or ``early_pages_share`` (this decode life would hold more than its share)."""
        self._expire(now)
        if self.pages + pages > self.limit:
            return "early_pages_limit"
        held = self._by_decode.get(decode, 0)
        if held + pages > self.per_decode:
            return "early_pages_share"
        holders, _ = self._rooms.pop(room, ({}, now))
        holders[decode] = holders.get(decode, 0) + pages
        self._rooms[room] = (holders, now + self.hold_s)
        self._by_decode[decode] = held + pages
        self.pages += pages
        return None

    def opened(self, room: int) -> None:
        holders, _ = self._rooms.pop(room, ({}, 0.0))
        self._release(holders)

    def _expire(self, now: float) -> None:
        while self._rooms:
            room, (holders, expires_at) = next(iter(self._rooms.items()))
            if now < expires_at:
                return
            del self._rooms[room]
            self._release(holders)

    def _release(self, holders: dict[PeerId, int]) -> None:
        for decode, pages in holders.items():
            left = self._by_decode[decode] - pages
            if left:
                self._by_decode[decode] = left
            else:
                del self._by_decode[decode]
            self.pages -= pages


class PrefillRankLimits:
    """What one prefill rank admits from decode ranks before the core sees it.

    A decode rank announces its KV layout (KvArgs) before its first message to a prefill rank,
    on the same socket, and the core keeps it (``layout_of`` asks it), so a RoomMetadata,
    BootstrapRequest or Abort from a decode life that never announced one is dropped
    (``unannounced_decode``): nothing unknown makes the rank park a message or open a reply
    socket. RoomMetadata must name pages that exist in the announced layout
    (``pages_out_of_range``); for a room the rank has not opened yet it is admitted within
    ``early``'s page limits (``early_pages_limit``, ``early_pages_share``)."""

    def __init__(self, max_early_pages: int, hold_s: float,
                 max_early_pages_per_decode: int | None = None) -> None:  # fmt: skip
        self.early = EarlyPages(max_early_pages, hold_s, max_early_pages_per_decode)

    def refusal(
        self, message: object, is_open: Callable[[int], bool],
        layout_of: Callable[[PeerId], KvArgs | None], now: float,
    ) -> str | None:  # fmt: skip
        """None to hand ``message`` to the core, else why it is dropped."""
        if not isinstance(message, RoomMetadata | BootstrapRequest | Abort):
            return None
        args = layout_of(message.decode)
        if args is None:
            return "unannounced_decode"
        if not isinstance(message, RoomMetadata) or not message.dst_pages:
            return None
        pages = message.dst_pages
        if min(pages) < 0 or max(pages) >= args.layout.num_pages:
            return "pages_out_of_range"
        if is_open(message.room):
            return None
        return self.early.admit(message.room, message.decode, len(pages), now)
