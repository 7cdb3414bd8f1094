"""One frozen settings object for a pdflow node, from explicit arguments and the environment.

Precedence, per field: an explicit argument, then ``PDFLOW_<NAME>``, then SGLang's variable where
pdflow's setting means the same thing, then the default. SGLang's floors (heartbeat interval at
least 2 s, at least 1 failure) apply to values read from SGLang's variables, so an SGLang
deployment behaves as before; pdflow's own names and explicit arguments only have to be valid.
An empty variable counts as unset. A bad value raises :class:`SettingsError` naming its source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from pdflow.core.protocol.policy import AllocationPolicy, Timeouts
from pdflow.core.resources.staging_ring import SMALL_ROOM_STAGING_LIMIT

TRANSPORT_PROTOCOLS = ("tcp", "rdma")
_MAX_PORT = 65535


class SettingsError(ValueError):
    """A setting has a value pdflow cannot use; the message names the argument or variable."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    bootstrap_token: str | None = None
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    heartbeat_interval: float = 5.0
    heartbeat_max_failure: int = 2
    lost_instance_forget: float = 600.0
    """Decode: a prefill instance declared dead and silent since is given up (no longer probed,
    never readmitted) this long after the verdict, once no room refers to it."""
    control_stall_limit: float = 30.0
    """Prefill: a rank whose control step has run this long has its process answer its health
    probe 503, naming the rank, so the decode treats a wedged process as a paused one. A step's
    longest legitimate wait is its sends, each bounded by the control channel's send timeout."""
    transfer_queues: int = 4
    dp_rank_ttl: float = 120.0
    bootstrap_max_body: int = 64 * 1024
    trace_enabled: bool = True
    trace_dir: str = ".pdflow/traces"
    trace_max_bytes: int = 256 * 1024 * 1024
    transport_protocol: str = "tcp"
    checksum: bool = False
    allocation_policy: AllocationPolicy = AllocationPolicy.EARLY
    control_max_sockets: int = 512
    control_max_peers: int = 1024
    control_max_layout_bytes: int = 64 << 10
    control_max_early_pages: int = 1 << 20
    control_max_early_pages_per_decode: int | None = None
    """The early pages (control_max_early_pages) one decode life may hold at a prefill rank, so
    one decode cannot use up the budget the others' metadata needs; None: a quarter of them."""
    control_mac_window: float = 30.0
    rotate_quarantine_percent: float = 0.0
    """Decode: rotate the transport engine (fence by engine rotation, docs/operations.md) when a
    rank's pages held only for dead writers exceed this percent of its pool, or when any
    staging-ring region is held only for dead writers (however small, it pins the ring's
    watermark); 0 turns it off."""
    small_room_staging_bytes: int = 0
    """Decode: a room of one writer whose pages take at most this many bytes goes as ONE bulk
    write through the staging ring (the prefill gathers it, this node scatters it) instead of
    one write per buffer, when a ring region is free at once (docs/operations.md, "Small-room
    staging"), and only for a prefill whose registered staging slots hold the room; at most
    65536; 0: off. The SGLang backend turns it on (16384) unless this variable is set."""
    metrics_port: int | None = None
    """Serve ``GET /metrics`` on this port of ``host`` (0: any free port; None: not served)."""
    collect_garbage_at_start: bool = True
    """Run one full garbage collection when a node has started, before it serves: an
    import-heavy start-up (torch, the engine) leaves the collector's full pass due, and it
    would otherwise fall on the first requests (a ~0.4 s pause over ~640k objects here)."""

    def __repr__(self) -> str:
        # The token is a secret: settings get logged, the token must not be.
        shown = {
            name: ("***" if name == "bootstrap_token" and value is not None else value)
            for name, value in msgspec.structs.asdict(self).items()
        }
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def timeouts_from(settings: Settings) -> Timeouts:
    """The room machines' timer budgets."""
    return Timeouts(
        bootstrap_timeout=settings.bootstrap_timeout, waiting_timeout=settings.waiting_timeout
    )


# ---- parsing: text -> value (format errors), checking: value -> problem (range errors) -------
def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError(f"{text!r} is not a boolean (use one of 1/0, true/false, yes/no, on/off)")


def _parse_text(text: str) -> str:
    return text


def _parse_policy(text: str) -> AllocationPolicy:
    try:
        return AllocationPolicy(text.strip())
    except ValueError:
        choices = ", ".join(p.value for p in AllocationPolicy)
        raise ValueError(f"{text!r} is not an allocation policy (one of {choices})") from None


def _positive(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return None if ok else f"{value!r} must be a positive number"


def _positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return None if ok else f"{value!r} must be a positive integer"


def _port(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_PORT
    return None if ok else f"{value!r} must be a TCP port in [0, {_MAX_PORT}] (0: any free port)"


def _optional_positive_int(value: Any) -> str | None:
    return None if value is None else _positive_int(value)


def _optional_port(value: Any) -> str | None:
    return None if value is None else _port(value)


def _non_empty_text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else f"{value!r} must be a non-empty string"


def _optional_text(value: Any) -> str | None:
    return None if value is None else _non_empty_text(value)


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{value!r} must be a boolean"


def _transport(value: Any) -> str | None:
    ok = value in TRANSPORT_PROTOCOLS
    return None if ok else f"{value!r} must be one of {', '.join(TRANSPORT_PROTOCOLS)}"


def _percent(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100
    return None if ok else f"{value!r} must be a percent between 0 and 100 (0: off)"


def _small_room_bytes(value: Any) -> str | None:
    ok = (isinstance(value, int) and not isinstance(value, bool)
          and 0 <= value <= SMALL_ROOM_STAGING_LIMIT)  # fmt: skip
    return None if ok else f"{value!r} must be bytes in [0, {SMALL_ROOM_STAGING_LIMIT}] (0: off)"


def _policy(value: Any) -> str | None:
    ok = isinstance(value, AllocationPolicy)
    return None if ok else f"{value!r} must be an AllocationPolicy"


@dataclass(frozen=True)
class _Field:
    parse: Callable[[str], Any]
    check: Callable[[Any], str | None]
    sglang: str | None = None
    sglang_floor: float | None = None


_FIELDS: dict[str, _Field] = {
    "host": _Field(_parse_text, _non_empty_text),
    "bootstrap_port": _Field(_parse_int, _port),
    "bootstrap_token": _Field(_parse_text, _optional_text),
    "bootstrap_timeout": _Field(_parse_float, _positive, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"),
    "waiting_timeout": _Field(_parse_float, _positive, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"),
    "heartbeat_interval": _Field(
        _parse_float, _positive, "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 2.0
    ),
    "heartbeat_max_failure": _Field(
        _parse_int, _positive_int, "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 1
    ),
    "control_stall_limit": _Field(_parse_float, _positive),
    "lost_instance_forget": _Field(_parse_float, _positive),
    "transfer_queues": _Field(_parse_int, _positive_int, "SGLANG_DISAGGREGATION_QUEUE_SIZE"),
    "dp_rank_ttl": _Field(
        _parse_float, _positive, "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL"
    ),
    "bootstrap_max_body": _Field(_parse_int, _positive_int),
    "trace_enabled": _Field(_parse_bool, _boolean),
    "trace_dir": _Field(_parse_text, _non_empty_text),
    "trace_max_bytes": _Field(_parse_int, _positive_int),
    "transport_protocol": _Field(lambda text: text.strip().lower(), _transport),
    "checksum": _Field(_parse_bool, _boolean),
    "allocation_policy": _Field(_parse_policy, _policy),
    "control_max_sockets": _Field(_parse_int, _positive_int),
    "control_max_peers": _Field(_parse_int, _positive_int),
    "control_max_layout_bytes": _Field(_parse_int, _positive_int),
    "control_max_early_pages": _Field(_parse_int, _positive_int),
    "control_max_early_pages_per_decode": _Field(_parse_int, _optional_positive_int),
    "control_mac_window": _Field(_parse_float, _positive),
    "small_room_staging_bytes": _Field(_parse_int, _small_room_bytes),
    "metrics_port": _Field(_parse_int, _optional_port),
    "collect_garbage_at_start": _Field(_parse_bool, _boolean),
    "rotate_quarantine_percent": _Field(_parse_float, _percent),
}

# The variable pdflow reads for a field, where it is not simply PDFLOW_<FIELD NAME>.
_PDFLOW_NAMES = {"trace_enabled": "PDFLOW_TRACE"}


def pdflow_variable(field: str) -> str:
    return _PDFLOW_NAMES.get(field, f"PDFLOW_{field.upper()}")


def load_settings(env: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
    """Build the settings; ``explicit`` arguments set to None count as not given.

    ``env`` defaults to ``os.environ``; tests pass a dict.
    """
    unknown = sorted(set(explicit) - set(_FIELDS))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; known: {sorted(_FIELDS)}")
    environ = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, field in _FIELDS.items():
        found = _value_of(name, field, explicit.get(name), environ)
        if found is not None:
            values[name] = found
    return Settings(**values)


def _value_of(name: str, field: _Field, given: Any, env: Mapping[str, str]) -> Any:
    if given is not None:
        return _checked(f"argument {name}", given, field)
    pdflow_name = pdflow_variable(name)
    candidates = [(pdflow_name, None), (field.sglang, field.sglang_floor)]
    for variable, floor in candidates:
        text = env.get(variable, "") if variable else ""
        if not text:
            continue
        try:
            value = field.parse(text)
        except ValueError as exc:
            raise SettingsError(f"{variable}={text!r}: {exc}") from None
        if floor is not None and isinstance(value, int | float):
            value = type(value)(max(value, floor))
        return _checked(f"{variable}={text!r}", value, field)
    return None


def _checked(source: str, value: Any, field: _Field) -> Any:
    problem = field.check(value)
    if problem is not None:
        raise SettingsError(f"{source}: {problem}")
    return value
