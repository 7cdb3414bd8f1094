"""Registry: the pure part of the bootstrap server (prefill ranks, topology, room -> dp rank).

Every HTTP request of the bootstrap server becomes one input; every input that asks something
gets exactly one :class:`Reply` (status and body, texts as SGLang answers them). The registry
collects the prefill ranks' registrations until ``dp * cp * tp * pp`` *distinct* ranks are known
(a re-registration replaces its rank, e.g. a restarted prefill with a new incarnation, and is
never counted twice), then answers topology and rank queries. A refused registration (no token,
malformed, inconsistent with the first one, or from a superseded incarnation) changes nothing.

Registrations are ordered: pdflow's prefill sends its process start time (``started_at``,
read by the shell) with its incarnation. A registration that started before the incarnation
holding its rank is refused, and once a rank is taken over by another incarnation, the one it
replaced is *superseded*: each later registration from it gets 409 and changes nothing, so a
dead process retrying a late PUT can never take its rank back. SGLang's prefill sends neither
field; its registrations replace their rank as before. A registration is checked against the
registry's wall clock (``received_at``, stamped by the HTTP layer): a ``started_at`` more than
``STARTED_AT_TOLERANCE_S`` ahead of it is refused, so a skewed or hostile clock cannot lock a
rank for good. See spec/machines/registry.toml and ``[registry]`` in spec/protocol.toml.

The shared token travels in the request inputs but never shows in their ``repr`` (nor in rich's
pretty printing): a log line or traceback that prints an input cannot leak it.
"""

from __future__ import annotations

import enum
import hmac
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import msgspec

from pdflow.core.framework.table import Table, TableMachine, row
from pdflow.core.protocol.inputs import Input, Tick
from pdflow.core.protocol.outputs import Output
from pdflow.core.protocol.policy import AllocationPolicy

DEFAULT_DP_RANK_TTL_S = 120.0
"""How long a room -> dp rank entry lives (SGLang's BOOTSTRAP_ENTRY_CLEANUP_INTERVAL)."""

MAX_INCARNATION_CHARS = 128
"""Longest incarnation a registration may carry (pdflow draws 32 hex digits): the registry keeps
incarnations (held ranks, superseded lives), so their size must be bounded."""

STARTED_AT_TOLERANCE_S = 300.0
"""How far a registration's ``started_at`` may lie ahead of the registry's wall clock (clock
skew between hosts). Further ahead it is refused: a process cannot start in the future, and a
start time of, say, 1e300 would make every later life of the rank look older (409) for good."""

SUPERSEDED_MEMORY = 64
"""How many superseded incarnations that hold no rank any more the registry remembers (the
most recently superseded ones). See :meth:`Registry._forget_old_lives`."""

OK = "OK"
MISSING_INPUTS = "Missing inputs for bootstrap server."
"""SGLang's answer to a rank query lacking a parameter; the HTTP layer sends it."""


class RegistryState(enum.Enum):
    COLLECTING = "COLLECTING"
    READY = "READY"


# ---- inputs -------------------------------------------------------------------------------------
_MASK = "<hidden>"


def _masked_repr(self: msgspec.Struct) -> str:
    """The Struct's repr with the token hidden: inputs get logged and show in tracebacks."""
    fields = ", ".join(f"{name}={value!r}" for name, value in _masked_fields(self))
    return f"{type(self).__name__}({fields})"


def _masked_fields(self: msgspec.Struct) -> list[tuple[str, Any]]:
    """The fields as rich's pretty printer reads them (``__rich_repr__``), token hidden."""
    return [
        (name, _MASK if name == "token" and getattr(self, name) is not None
         else getattr(self, name))
        for name in self.__struct_fields__
    ]


class RegisterRank(Input, frozen=True, gc=True, tag="RegisterRank"):  # holds a dict: tracked
    """``PUT /route``: one prefill rank announces itself (SGLang's fields, plus pdflow's)."""

    attn_tp_size: int
    attn_tp_rank: int
    attn_cp_size: int
    attn_cp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str
    load_balance_method: str | None = None
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    prefill_http_port: int | None = None
    dsv41_spec_layout: dict[str, Any] | None = None
    decode_allocation_policy: AllocationPolicy = AllocationPolicy.EARLY
    incarnation: str | None = None
    protocol_version: int | None = None
    started_at: float | None = None
    """When this process life began (seconds since the Unix epoch, from the prefill's clock):
    the order of two process lives of one rank. Optional (SGLang sends none)."""
    checksum: bool | None = None
    """Whether this prefill sends KV checksums with its Success reports; None: not declared."""
    is_mla: bool | None = None
    """Whether this prefill's KV is MLA (one latent head; one writer per decode rank, the other
    TP ranks dummies); None: not declared (SGLang sends none)."""
    health: str | None = None
    """``host:port`` of the rank's process's own health endpoint (pdflow's PrefillNode serves
    one), so the decode notices a dead process even behind an external registry."""
    staging_slot_bytes: int | None = None
    """How many bytes one of this rank's local staging slots holds (one slot per transfer
    worker): a decode stages a small room for this prefill only when a slot holds it.
    None: not declared (SGLang sends none), so no small room is staged for it."""
    token: str | None = None
    """From the HTTP header, never from the body; hidden from ``repr``."""
    received_at: float | None = None
    """The registry's wall clock (seconds since the Unix epoch) when the registration arrived:
    stamped by the HTTP layer, never from the body. None (in-process use): not checked."""

    __repr__ = _masked_repr
    __rich_repr__ = _masked_fields

    @property
    def dp_size(self) -> int:
        return self.attn_dp_size if self.system_dp_size == 1 else self.system_dp_size

    @property
    def dp_group(self) -> int:
        """SGLang's rule: the attention dp rank unless the system runs several dp groups."""
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @property
    def rank_key(self) -> tuple[int, int, int, int]:
        return (self.dp_group, self.attn_cp_rank, self.attn_tp_rank, self.pp_rank)

    @property
    def world(self) -> int:
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size


class QueryTopology(Input, frozen=True, tag="QueryTopology"):
    """``GET /route`` with all four ranks -1: the prefill's parallel layout."""

    token: str | None = None

    __repr__ = _masked_repr
    __rich_repr__ = _masked_fields


class QueryRank(Input, frozen=True, tag="QueryRank"):
    """``GET /route`` for one prefill rank: its control address, so it needs the token."""

    dp: int
    cp: int
    tp: int
    pp: int
    token: str | None = None

    __repr__ = _masked_repr
    __rich_repr__ = _masked_fields


class RegisterDpRank(Input, frozen=True, tag="RegisterDpRank"):
    """``POST /register_dp_rank``: the prefill dp rank that serves a room."""

    room: int
    dp_rank: int
    token: str | None = None

    __repr__ = _masked_repr
    __rich_repr__ = _masked_fields


class QueryDpRanks(Input, frozen=True, tag="QueryDpRanks"):
    """``POST /query_dp_ranks``: the dp rank of each room, for the rooms still known."""

    rooms: tuple[int, ...]
    token: str | None = None

    __repr__ = _masked_repr
    __rich_repr__ = _masked_fields


class CheckHealth(Input, frozen=True, tag="CheckHealth"):
    """``GET /health``: the decode's heartbeat."""


def declared_checksum(ranks: Iterable[PrefillRankInfo]) -> bool | None:
    """The prefill instance's checksum setting from its rank answers: None unless every rank
    declared the same one (the registry keeps declared settings consistent)."""
    return _declared({rank.checksum for rank in ranks})


def declared_staging_slot_bytes(ranks: Iterable[PrefillRankInfo]) -> int:
    """The staging slot every rank of the prefill instance holds: the smallest one declared,
    0 when any rank declared none (a decode then stages no small room for that instance)."""
    return min((rank.staging_slot_bytes or 0 for rank in ranks), default=0)


def declared_is_mla(ranks: Iterable[PrefillRankInfo]) -> bool | None:
    """The prefill instance's attention kind (MLA or not) from its rank answers, likewise."""
    return _declared({rank.is_mla for rank in ranks})


def _declared(values: set[bool | None]) -> bool | None:
    return values.pop() if len(values) == 1 else None


def route_query(
    dp: int, cp: int, tp: int, pp: int, token: str | None = None
) -> QueryTopology | QueryRank:
    """SGLang's sentinel: all four ranks -1 asks for the topology, anything else for a rank."""
    if (dp, cp, tp, pp) == (-1, -1, -1, -1):
        return QueryTopology(token)
    return QueryRank(dp, cp, tp, pp, token)


_Authorized = RegisterRank | RegisterDpRank | QueryTopology | QueryRank | QueryDpRanks
"""The requests that need the shared token when the registry has one (all but CheckHealth)."""

_GUARDED_REQUESTS: dict[type[Input], str] = {
    RegisterRank: "registration (PUT /route)",
    RegisterDpRank: "dp rank registration (POST /register_dp_rank)",
    QueryTopology: "topology read (GET /route)",
    QueryRank: "rank read (GET /route)",
    QueryDpRanks: "dp rank read (POST /query_dp_ranks)",
}


# ---- answers --------------------------------------------------------------------------------
class Reply(Output, frozen=True, gc=True, tag="reply"):  # holds a dict: tracked
    """The answer to one request: a text body (text/plain) or a JSON object."""

    status: int
    body: str | dict[str, Any]


class PrefillServerInfo(msgspec.Struct, frozen=True):
    """The topology answer, field for field SGLang's ``PrefillServerInfo``.

    SGLang's decode builds its dataclass with ``PrefillServerInfo(**json)``, so no field may be
    added here: pdflow's per-rank additions (incarnation) travel in :class:`PrefillRankInfo`.
    The ``target_*`` and ``required_*`` fields are filled in by the decode's rank mapping.
    """

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool = True
    enable_dsa_cache_layer_split: bool = False
    decode_allocation_policy: AllocationPolicy = AllocationPolicy.EARLY
    enable_kv_cache_sharding: bool = False
    prefill_http_port: int | None = None
    target_tp_rank: int | None = None
    target_tp_ranks: list[int] | None = None
    target_cp_ranks: list[int] | None = None
    target_pp_ranks: list[int] | None = None
    required_dst_info_num: int | None = None
    required_prefill_response_num: int | None = None
    dsv41_spec_layout: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = msgspec.to_builtins(self)
        if body["dsv41_spec_layout"] is None:
            del body["dsv41_spec_layout"]  # SGLang omits it when unset
        return body


class PrefillRankInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """The rank answer: SGLang's ``{rank_ip, rank_port}`` plus pdflow's identity of the rank."""

    rank_ip: str
    rank_port: int
    incarnation: str | None = None
    protocol_version: int | None = None
    started_at: float | None = None
    checksum: bool | None = None
    is_mla: bool | None = None
    health: str | None = None
    staging_slot_bytes: int | None = None


class RegistrySnapshot(msgspec.Struct, frozen=True):
    """Everything observable about the registry (tokens left out)."""

    state: str
    first: RegisterRank | None
    ranks: tuple[tuple[tuple[int, int, int, int], PrefillRankInfo], ...]
    room_dp_ranks: tuple[tuple[int, int, float], ...]
    superseded: tuple[str, ...] = ()
    registrations: tuple[tuple[tuple[int, int, int, int], RegisterRank], ...] = ()


# ---- the table ------------------------------------------------------------------------------
_G = RegistryState
_REPLY = ["reply"]

_ALL_INPUTS = (
    RegisterRank,
    QueryTopology,
    QueryRank,
    RegisterDpRank,
    QueryDpRanks,
    Tick,
    CheckHealth,
)


def _answers_in_every_state(state: RegistryState) -> list[Any]:
    """The rows that read the same whatever the readiness."""
    return [
        # Reads reveal the prefill's endpoints: with a token set they need it too.
        row(state, QueryTopology, state, guard=_M._guard_unauthorized, emits=_REPLY,
            action=_M._act_refuse_unauthorized),
        row(state, QueryRank, state, guard=_M._guard_unauthorized, emits=_REPLY,
            action=_M._act_refuse_unauthorized),
        row(
            state,
            RegisterRank,
            state,
            guard=_M._guard_unauthorized,
            emits=_REPLY,
            action=_M._act_refuse_unauthorized,
        ),
        row(state, RegisterRank, state, guard=_M._guard_malformed, emits=_REPLY,
            action=_M._act_refuse_malformed),
        row(
            state,
            RegisterRank,
            state,
            guard=_M._guard_superseded,
            emits=_REPLY,
            action=_M._act_refuse_superseded,
        ),
        row(
            state,
            RegisterRank,
            state,
            guard=_M._guard_inconsistent,
            emits=_REPLY,
            action=_M._act_refuse_inconsistent,
        ),
    ]


def _room_rows(state: RegistryState) -> list[Any]:
    return [
        row(
            state,
            RegisterDpRank,
            state,
            guard=_M._guard_unauthorized,
            emits=_REPLY,
            action=_M._act_refuse_unauthorized,
        ),
        row(
            state, RegisterDpRank, state, guard=_M._guard_bad_dp_rank, emits=_REPLY,
            action=_M._act_refuse_dp_rank
        ),
        row(state, RegisterDpRank, state, emits=_REPLY, action=_M._act_record_dp_rank),
        row(state, QueryDpRanks, state, guard=_M._guard_unauthorized, emits=_REPLY,
            action=_M._act_refuse_unauthorized),
        row(state, QueryDpRanks, state, emits=_REPLY, action=_M._act_answer_dp_ranks),
        row(state, Tick, state, action=_M._act_expire_rooms),
        row(state, CheckHealth, state, emits=_REPLY, action=_M._act_answer_health),
    ]


# The parallel sizes: every registration must agree with the first one, for the registry's life
# (readiness counts ranks of this world, and held ranks are keyed in it).
_SIZE_FIELDS: tuple[tuple[str, str], ...] = (
    ("attn_tp_size", "Inconsistent prefill topology"),
    ("attn_cp_size", "Inconsistent prefill topology"),
    ("attn_dp_size", "Inconsistent prefill topology"),
    ("system_dp_size", "Inconsistent prefill topology"),
    ("pp_size", "Inconsistent prefill topology"),
)
# Settings every rank of one prefill instance shares: (field, headline of the 400 answer). SGLang
# takes each from its server arguments (load_balance_method, enable_* and prefill_http_port are
# global there), so the ranks of one instance always agree; a registration is checked against
# the live ranks (those of no superseded life), so a restarted instance may change them. The two
# headlines that SGLang also checks are its own texts, so logs read the same.
_CONSISTENT_FIELDS: tuple[tuple[str, str], ...] = (
    ("page_size", "Inconsistent prefill page size"),
    ("kv_cache_dtype", "Inconsistent prefill KV cache dtype"),
    ("decode_allocation_policy", "Inconsistent prefill allocation policies"),
    ("dsv41_spec_layout", "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks"),
    ("protocol_version", "Inconsistent pdflow protocol versions"),
    ("checksum", "Inconsistent prefill KV checksum settings (PDFLOW_CHECKSUM)"),
    ("is_mla", "Inconsistent prefill attention kinds (MLA on some ranks only)"),
    ("prefill_http_port", "Inconsistent prefill HTTP ports (prefill_http_port)"),
    ("load_balance_method", "Inconsistent prefill load balance methods"),
    ("enable_dsa_cache_layer_split", "Inconsistent prefill DSA cache layer split settings"),
    ("enable_kv_cache_sharding", "Inconsistent prefill KV cache sharding settings"),
)
_FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"
_MAX_PORT = 65535
# Sizes past this describe no deployment (a page of a million tokens, a million TP ranks): a
# bound keeps arithmetic on them (pages x page size, ranks x ranks) small.
_MAX_SIZE = 1 << 20
_MAX_HOST_CHARS = 255
_SHOWN_CHARS = 100


class Registry(TableMachine[RegistryState]):
    """The bootstrap registry of one prefill instance. Drive it with :meth:`handle`."""

    table: Table[RegistryState]

    def __init__(
        self, *, token: str | None = None, dp_rank_ttl: float = DEFAULT_DP_RANK_TTL_S
    ) -> None:
        if token == "":
            raise ValueError("the bootstrap token must be non-empty, or None for no token")
        if dp_rank_ttl <= 0:
            raise ValueError(f"dp_rank_ttl must be positive seconds, got {dp_rank_ttl}")
        self.key = 0
        self.state = REGISTRY_TABLE.initial
        self._token = token
        self.dp_rank_ttl = dp_rank_ttl
        # The reference registration: the topology answer and the parallel sizes come from it.
        # Always one of a live process life (see _act_register).
        self.first: RegisterRank | None = None
        self.ranks: dict[tuple[int, int, int, int], PrefillRankInfo] = {}
        # The accepted registration of each held rank (token and arrival time left out): newer
        # registrations are checked against these.
        self.registrations: dict[tuple[int, int, int, int], RegisterRank] = {}
        # Incarnations a newer one replaced, oldest first: each of their registrations is refused
        # (409). Bounded: see _forget_old_lives.
        self.superseded: dict[str, None] = {}
        # Insertion order is registration order (a re-registration moves to the end), so with
        # a non-decreasing ``now`` the oldest entry is first: expiry pops from the front.
        self.room_dp_ranks: dict[int, tuple[int, float]] = {}

    # ---- public API ----------------------------------------------------------------------------
    @property
    def requires_token(self) -> bool:
        return self._token is not None

    def accepts_token(self, given: str | None) -> bool:
        """Whether ``given`` is the shared token (always, when the registry has none). The HTTP
        layer asks before it reads a body, so a request without the token learns nothing."""
        if self._token is None:
            return True
        if given is None:
            return False
        return hmac.compare_digest(_utf8(given), _utf8(self._token))

    def redacted(self, text: str) -> str:
        """``text`` with the shared token blanked out (for logs)."""
        return text if self._token is None else text.replace(self._token, _MASK)

    def reply_to(self, inp: Input, now: float) -> Reply:
        """Handle a request and return its one answer (every input but ``Tick`` has one)."""
        outputs, _ = self.fire(inp, now)
        replies = [o for o in outputs if isinstance(o, Reply)]
        if len(replies) != 1:
            raise ValueError(f"{type(inp).__name__} is not a request: it gets no reply")
        return replies[0]

    def timer_at(self) -> float | None:
        """When the oldest room -> dp rank entry expires."""
        oldest = next(iter(self.room_dp_ranks.values()), None)
        return None if oldest is None else oldest[1] + self.dp_rank_ttl

    def snapshot(self) -> RegistrySnapshot:
        first = None if self.first is None else msgspec.structs.replace(self.first, token=None)
        return RegistrySnapshot(
            state=self.state.name,
            first=first,
            ranks=tuple(sorted(self.ranks.items())),
            room_dp_ranks=tuple(
                sorted((room, dp, at) for room, (dp, at) in self.room_dp_ranks.items())
            ),
            superseded=tuple(sorted(self.superseded)),
            registrations=tuple(sorted(self.registrations.items())),
        )

    # ---- guards --------------------------------------------------------------------------------
    def _guard_unauthorized(self, inp: _Authorized, now: float) -> bool:
        return not self.accepts_token(inp.token)

    def _guard_malformed(self, inp: RegisterRank, now: float) -> bool:
        return _malformation(inp) is not None

    def _guard_superseded(self, inp: RegisterRank, now: float) -> bool:
        return self._supersession(inp) is not None

    def _guard_inconsistent(self, inp: RegisterRank, now: float) -> bool:
        return self._inconsistency(inp) is not None

    def _guard_completes_topology(self, inp: RegisterRank, now: float) -> bool:
        reg = inp
        return len(self.ranks.keys() | {reg.rank_key}) >= reg.world

    def _guard_rank_registered(self, inp: QueryRank, now: float) -> bool:
        q = inp
        return (q.dp, q.cp, q.tp, q.pp) in self.ranks

    def _guard_bad_dp_rank(self, inp: RegisterDpRank, now: float) -> bool:
        return self._dp_rank_problem(inp) is not None

    # ---- actions -------------------------------------------------------------------------------
    def _act_refuse_unauthorized(self, inp: Input, now: float) -> list[Output]:
        return [unauthorized_reply(type(inp))]

    def _act_refuse_malformed(self, inp: RegisterRank, now: float) -> list[Output]:
        return [Reply(400, cast(str, _malformation(inp)))]

    def _act_refuse_inconsistent(self, inp: RegisterRank, now: float) -> list[Output]:
        return [Reply(400, cast(str, self._inconsistency(inp)))]

    def _act_refuse_superseded(self, inp: RegisterRank, now: float) -> list[Output]:
        return [Reply(409, cast(str, self._supersession(inp)))]

    def _act_register(self, inp: RegisterRank, now: float) -> list[Output]:
        reg = msgspec.structs.replace(inp, token=None, received_at=None)
        if self.first is None:
            self._forget_rooms_beyond(reg.dp_size)
        replaced = self._replaced_life(reg)
        if replaced is not None:
            self.superseded.pop(replaced, None)  # now the most recently superseded
            self.superseded[replaced] = None
        self.ranks[reg.rank_key] = PrefillRankInfo(
            reg.rank_ip, reg.rank_port, reg.incarnation, reg.protocol_version, reg.started_at,
            reg.checksum, reg.is_mla, reg.health, reg.staging_slot_bytes,
        )
        self.registrations[reg.rank_key] = reg
        # The reference follows the live instance: once its own registration is replaced, or its
        # process life superseded (a restarted prefill), the topology answer must describe the
        # new life (its HTTP port, page size, protocol version...). ``reg`` agrees with every
        # other live rank on every topology field (_inconsistency), so it can stand for them.
        first = self.first
        if first is None or first.rank_key == reg.rank_key or first.incarnation in self.superseded:
            self.first = reg
        self._forget_old_lives()
        return [Reply(200, OK)]

    def _act_answer_not_ready(self, inp: Input, now: float) -> list[Output]:
        count = len(self.ranks)
        text = f"Prefill server not fully registered yet ({count} workers registered)."
        return [Reply(503, text)]

    def _act_answer_topology(self, inp: Input, now: float) -> list[Output]:
        first = cast(RegisterRank, self.first)
        info = PrefillServerInfo(
            attn_tp_size=first.attn_tp_size,
            attn_cp_size=first.attn_cp_size,
            dp_size=first.dp_size,
            pp_size=first.pp_size,
            page_size=first.page_size,
            kv_cache_dtype=first.kv_cache_dtype,
            follow_bootstrap_room=first.load_balance_method in (None, "follow_bootstrap_room"),
            enable_dsa_cache_layer_split=first.enable_dsa_cache_layer_split,
            decode_allocation_policy=first.decode_allocation_policy,
            enable_kv_cache_sharding=first.enable_kv_cache_sharding,
            prefill_http_port=first.prefill_http_port,
            dsv41_spec_layout=first.dsv41_spec_layout,
        )
        return [Reply(200, info.to_wire())]

    def _act_answer_rank(self, inp: QueryRank, now: float) -> list[Output]:
        q = inp
        info = self.ranks[(q.dp, q.cp, q.tp, q.pp)]
        return [Reply(200, msgspec.to_builtins(info))]

    def _act_answer_unknown_rank(self, inp: QueryRank, now: float) -> list[Output]:
        q = inp
        return [
            Reply(
                404,
                f"Bootstrap info not found for dp_rank={q.dp} cp_rank={q.cp} "
                f"tp_rank={q.tp} pp_rank={q.pp}",
            )
        ]

    def _act_refuse_dp_rank(self, inp: RegisterDpRank, now: float) -> list[Output]:
        return [Reply(400, cast(str, self._dp_rank_problem(inp)))]

    def _act_record_dp_rank(self, inp: RegisterDpRank, now: float) -> list[Output]:
        reg = inp
        self.room_dp_ranks.pop(reg.room, None)
        self.room_dp_ranks[reg.room] = (reg.dp_rank, now)
        return [Reply(200, OK)]

    def _forget_rooms_beyond(self, dp_size: int) -> None:
        """The dp size just became known: drop the rooms recorded for a dp rank it lacks (they
        were taken unchecked while no rank had registered)."""
        for room in [r for r, (dp, _) in self.room_dp_ranks.items() if dp >= dp_size]:
            del self.room_dp_ranks[room]

    def _act_answer_dp_ranks(self, inp: QueryDpRanks, now: float) -> list[Output]:
        known: dict[str, Any] = {}
        for room in inp.rooms:
            entry = self.room_dp_ranks.get(room)
            # Expiry is exact here, so answers never depend on when the last Tick ran.
            if entry is not None and now < entry[1] + self.dp_rank_ttl:
                known[str(room)] = entry[0]
        return [Reply(200, known)]

    def _act_expire_rooms(self, inp: Input, now: float) -> list[Output]:
        expired = []
        for room, (_, registered_at) in self.room_dp_ranks.items():
            if now < registered_at + self.dp_rank_ttl:
                break
            expired.append(room)
        for room in expired:
            del self.room_dp_ranks[room]
        return []

    def _act_answer_health(self, inp: Input, now: float) -> list[Output]:
        return [Reply(200, OK)]

    # ---- helpers -------------------------------------------------------------------------------
    def _replaced_life(self, reg: RegisterRank) -> str | None:
        """The incarnation ``reg`` takes its rank from (which it thereby supersedes), or None."""
        held = self.ranks.get(reg.rank_key)
        if held is None or reg.incarnation is None or held.incarnation in (None, reg.incarnation):
            return None
        return held.incarnation

    def _forget_old_lives(self) -> None:
        """Bound the superseded set. It must refuse a dead life's *late* registration, a retry
        that arrives soon after the restart; an incarnation that still holds a rank is always
        kept (it is a dead life whose ranks are not all replaced yet), and of the others only the
        SUPERSEDED_MEMORY most recently superseded. A forgotten one is still refused when it
        sends its start time (pdflow's prefill always does): it is older than the life holding
        its rank. Only one sending no start time, after that many newer lives, gets its rank
        back, and so its memory is bounded: (SUPERSEDED_MEMORY + held ranks) incarnations of at
        most MAX_INCARNATION_CHARS each."""
        if len(self.superseded) <= SUPERSEDED_MEMORY:
            return
        holding = {info.incarnation for info in self.ranks.values()}
        idle = [life for life in self.superseded if life not in holding]
        for life in idle[: max(len(idle) - SUPERSEDED_MEMORY, 0)]:
            del self.superseded[life]

    def _live_peer(self, reg: RegisterRank) -> RegisterRank | None:
        """A held registration ``reg`` must agree with: of another rank, from a life that is
        neither superseded nor about to be superseded by ``reg`` (a restarted prefill may change
        its settings). Live registrations agree with one another, so any one will do."""
        replaced = self._replaced_life(reg)
        for key, other in self.registrations.items():
            dead = other.incarnation is not None and (
                other.incarnation == replaced or other.incarnation in self.superseded)
            if key != reg.rank_key and not dead:
                return other
        return None

    def _inconsistency(self, reg: RegisterRank) -> str | None:
        first = self.first
        if first is None:
            return None
        differs = _first_difference(reg, first, _SIZE_FIELDS)
        if differs is not None:
            headline, field, mine, theirs = differs
            return (
                f"{headline}: {field}={mine} differs from {field}={theirs} "
                f"of prefill rank {_where(first)}, registered first; the parallel sizes of a "
                "prefill instance cannot change while its registry runs: start this rank "
                f"with {field}={theirs}, or restart the registry (pdflow bootstrap, "
                "or the prefill hosting it) together with every rank"
            )
        peer = self._live_peer(reg)
        differs = None if peer is None else _first_difference(reg, peer, _CONSISTENT_FIELDS)
        if peer is None or differs is None:
            return None
        headline, field, mine, theirs = differs
        return (
            f"{headline}: {field}={mine} differs from {field}={theirs} "
            f"of live prefill rank {_where(peer)}{_life(peer)}; "
            f"every rank of one prefill instance must send the same {field}: start "
            f"this rank with {field}={theirs}, or restart the whole instance "
            "with the new value (pdflow's prefill: a new incarnation replaces the old "
            "ranks; a prefill sending no incarnation: restart the registry too)"
        )

    def _supersession(self, reg: RegisterRank) -> str | None:
        """Why this registration comes from a process life older than one already known."""
        where = _where(reg)
        if reg.incarnation is not None and reg.incarnation in self.superseded:
            return (
                f"Superseded registration: incarnation {reg.incarnation} of prefill rank "
                f"{where} was replaced by a newer one; it is a dead or stale process life "
                "and must stop (a restarted prefill registers with a new incarnation)"
            )
        held = self.ranks.get(reg.rank_key)
        if held is None or held.incarnation == reg.incarnation:
            return None
        if reg.started_at is not None and held.started_at is not None and (
            reg.started_at < held.started_at
        ):
            return (
                f"Superseded registration: incarnation {reg.incarnation} (started_at="
                f"{reg.started_at!r}) of prefill rank {where} is older than incarnation "
                f"{held.incarnation} (started_at={held.started_at!r}) registered there; "
                "stop the old process"
            )
        return None

    def _dp_rank_problem(self, reg: RegisterDpRank) -> str | None:
        if reg.room < 0:
            return f"Malformed dp rank registration: bootstrap_room={reg.room} must be >= 0"
        if reg.dp_rank < 0:
            return f"Malformed dp rank registration: dp_rank={reg.dp_rank} must be >= 0"
        if self.first is not None and reg.dp_rank >= self.first.dp_size:
            return (
                f"Malformed dp rank registration: dp_rank={reg.dp_rank} must be below the "
                f"prefill's dp_size={self.first.dp_size}"
            )
        return None


_M = Registry
REGISTRY_TABLE: Table[RegistryState] = Table(
    machine="Registry",
    states=RegistryState,
    initial=RegistryState.COLLECTING,
    inputs=_ALL_INPUTS,
    remote_inputs=(RegisterRank, QueryTopology, QueryRank, RegisterDpRank, QueryDpRanks,
                   CheckHealth),
    rows=[
        # -- COLLECTING: fewer distinct ranks than dp*cp*tp*pp -----------------------------------
        *_answers_in_every_state(_G.COLLECTING),
        row(_G.COLLECTING, RegisterRank, _G.READY, guard=_M._guard_completes_topology, emits=_REPLY,
            action=_M._act_register),
        row(_G.COLLECTING, RegisterRank, _G.COLLECTING, emits=_REPLY, action=_M._act_register),
        row(_G.COLLECTING, QueryTopology, _G.COLLECTING, emits=_REPLY,
            action=_M._act_answer_not_ready),
        row(_G.COLLECTING, QueryRank, _G.COLLECTING, emits=_REPLY, action=_M._act_answer_not_ready),
        *_room_rows(_G.COLLECTING),
        # -- READY: every rank known; re-registrations replace their rank -------------------------
        *_answers_in_every_state(_G.READY),
        row(_G.READY, RegisterRank, _G.READY, emits=_REPLY, action=_M._act_register),
        row(_G.READY, QueryTopology, _G.READY, emits=_REPLY, action=_M._act_answer_topology),
        row(_G.READY, QueryRank, _G.READY, guard=_M._guard_rank_registered, emits=_REPLY,
            action=_M._act_answer_rank),
        row(_G.READY, QueryRank, _G.READY, emits=_REPLY, action=_M._act_answer_unknown_rank),
        *_room_rows(_G.READY),
    ],
    keyed_by_room=False,
)  # fmt: skip
Registry.table = REGISTRY_TABLE


def unauthorized_reply(kind: type[Input]) -> Reply:
    """The 401 answer to a request of ``kind`` without the shared token."""
    return Reply(
        401,
        f"Unauthorized: this bootstrap server requires the shared token "
        f"(PDFLOW_BOOTSTRAP_TOKEN) for a {_GUARDED_REQUESTS[kind]}: send it as "
        "'Authorization: Bearer <token>' or 'X-Pdflow-Token: <token>'",
    )


def _is_host(host: str) -> bool:
    """A host name or address peers can connect to: printable, without spaces, not too long."""
    return (0 < len(host) <= _MAX_HOST_CHARS and host.isprintable()
            and not any(c.isspace() for c in host))  # fmt: skip


def _malformation(reg: RegisterRank) -> str | None:
    """Why a registration cannot describe a real rank, or None."""
    sizes = (
        "attn_tp_size",
        "attn_cp_size",
        "attn_dp_size",
        "system_dp_size",
        "pp_size",
        "page_size",
    )
    for name in sizes:
        if not 1 <= getattr(reg, name) <= _MAX_SIZE:
            return (f"Malformed registration: {name}={getattr(reg, name)} must be in "
                    f"[1, {_MAX_SIZE}]")  # fmt: skip
    ranks = (
        ("attn_tp_rank", "attn_tp_size"),
        ("attn_cp_rank", "attn_cp_size"),
        ("attn_dp_rank", "attn_dp_size"),
        ("system_dp_rank", "system_dp_size"),
        ("pp_rank", "pp_size"),
    )
    for rank, size in ranks:
        value, bound = getattr(reg, rank), getattr(reg, size)
        if not 0 <= value < bound:
            return f"Malformed registration: {rank}={value} must be in [0, {size}={bound})"
    if not _is_host(reg.rank_ip):
        return (
            f"Malformed registration: rank_ip={_clipped(reg.rank_ip)} must be a host name or "
            f"address (printable, no spaces, at most {_MAX_HOST_CHARS} characters)"
        )
    if reg.protocol_version is not None and reg.protocol_version < 0:
        return f"Malformed registration: protocol_version={reg.protocol_version} must be >= 0"
    if not 1 <= reg.rank_port <= _MAX_PORT:
        return f"Malformed registration: rank_port={reg.rank_port} must be in [1, {_MAX_PORT}]"
    if reg.prefill_http_port is not None and not 1 <= reg.prefill_http_port <= _MAX_PORT:
        return (
            f"Malformed registration: prefill_http_port={reg.prefill_http_port} must be in "
            f"[1, {_MAX_PORT}] (or absent)"
        )
    if not reg.kv_cache_dtype:
        return "Malformed registration: kv_cache_dtype must be non-empty"
    if reg.incarnation == "":
        return "Malformed registration: incarnation, when given, must be non-empty"
    if reg.incarnation is not None and len(reg.incarnation) > MAX_INCARNATION_CHARS:
        return (
            f"Malformed registration: incarnation is {len(reg.incarnation)} characters long, "
            f"at most {MAX_INCARNATION_CHARS} are allowed (an id of the process life, e.g. "
            "32 hex digits)"
        )
    if reg.started_at is not None and not (math.isfinite(reg.started_at) and reg.started_at >= 0):
        return (
            f"Malformed registration: started_at={reg.started_at!r} must be seconds since the "
            "Unix epoch (finite, >= 0)"
        )
    if reg.staging_slot_bytes is not None and reg.staging_slot_bytes < 0:
        return (
            f"Malformed registration: staging_slot_bytes={reg.staging_slot_bytes} must be >= 0 "
            "(0 or absent: this rank holds no staging slots)"
        )
    if reg.health is not None and not _is_host_port(reg.health):
        return (
            f"Malformed registration: health={_clipped(reg.health)} must be host:port, the port "
            f"in ASCII digits within [1, {_MAX_PORT}]"
        )
    if reg.started_at is not None and reg.incarnation is None:
        return "Malformed registration: started_at orders process lives; send an incarnation too"
    if (reg.started_at is not None and reg.received_at is not None
            and reg.started_at > reg.received_at + STARTED_AT_TOLERANCE_S):
        return (
            f"Malformed registration: started_at={reg.started_at!r} is "
            f"{reg.started_at - reg.received_at:.0f} s ahead of the registry's clock "
            f"({reg.received_at:.0f}); a process cannot start in the future: fix the prefill "
            f"host's clock (NTP), more than {STARTED_AT_TOLERANCE_S:g} s of skew is refused"
        )
    return None


def _is_host_port(address: str) -> bool:
    """``host:port`` with a port of ASCII decimal digits in [1, 65535] (``str.isdigit`` also
    takes '²' and other scripts' digits, which ``int`` then refuses or reads)."""
    host, _, port = address.rpartition(":")
    return (_is_host(host) and 0 < len(port) <= 5 and port.isascii() and port.isdigit()
            and 1 <= int(port) <= _MAX_PORT)


def _first_difference(
    reg: RegisterRank, other: RegisterRank, fields: Sequence[tuple[str, str]]
) -> tuple[str, str, str, str] | None:
    """(headline, field, this value, the other's value), both shown, of the first field where
    the two registrations differ; None when they agree on all."""
    for field, headline in fields:
        mine, theirs = _compared(reg, field), _compared(other, field)
        if mine != theirs:
            return headline, field, _shown(mine), _shown(theirs)
    return None


def _compared(reg: RegisterRank, field: str) -> object:
    """A field as the consistency check compares it: no load balance method is SGLang's
    default, follow_bootstrap_room."""
    value = getattr(reg, field)
    if field == "load_balance_method" and value is None:
        return _FOLLOW_BOOTSTRAP_ROOM
    return value


def _where(reg: RegisterRank) -> str:
    return "dp={} cp={} tp={} pp={}".format(*reg.rank_key)


def _life(reg: RegisterRank) -> str:
    return "" if reg.incarnation is None else f" (incarnation {reg.incarnation})"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _clipped(text: str) -> str:
    shown = repr(text[:_SHOWN_CHARS])
    return shown if len(text) <= _SHOWN_CHARS else f"{shown}... ({len(text)} characters)"


def _shown(value: object) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, str):
        return _clipped(value)
    return repr(value)
