"""The bootstrap client (httpx): register prefill ranks, read the topology, heartbeat ``/health``.

Works against pdflow's server and SGLang's. Writes (rank and dp-rank registrations) retry
connection failures and 502/503/504 with capped, jittered exponential backoff; the jitter comes
from a ``random.Random`` the caller owns and seeds, so runs are reproducible. Topology reads
retry "not ready yet" (503) and refused connections until a deadline: the prefill may start
after the decode. Anything else is an error that says what the server answered.

httpx's timeouts bound each connect, write and read, not a request: a server that drips a byte
just within the read timeout holds a request for ever. So every request here has a total
deadline too (``timeout_s``; a health probe ``health_connect_s + health_read_s``).
"""

from __future__ import annotations

import functools
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
import httpx
import msgspec
import structlog

from pdflow.core.cluster.registry import PrefillRankInfo, PrefillServerInfo, RegisterRank

INCARNATION_HEADER = "X-Pdflow-Incarnation"
_RETRYABLE_STATUS = frozenset({502, 503, 504})
_DROPPED_UNANSWERED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
"""A request that got no answer because its connection was closed under it: on a pooled
keep-alive connection, what a server's idle-timeout close looks like to the next request."""
_ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, built once per process: httpx builds (and loads the
    CA bundle into) a new one for every client, even one that only speaks http://, and the
    prefill opens a client every heartbeat interval; that load showed in its profile."""
    return httpx.create_ssl_context()

log = structlog.get_logger("pdflow.bootstrap_client")


class BootstrapError(RuntimeError):
    """The bootstrap server refused a request, or answered something unusable."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class BootstrapUnavailable(BootstrapError):
    """Unreachable, or not ready, after every retry: check that the prefill is up."""


class RankNotFound(BootstrapError):
    """The server is ready but the asked prefill rank never registered (404)."""


class RetryPolicy(msgspec.Struct, frozen=True):
    """Backoff of attempt ``n`` (0-based): ``min(base * 2**n, cap) * uniform(jitter_low, 1)``."""

    attempts: int = 5
    base_s: float = 0.5
    cap_s: float = 30.0
    jitter_low: float = 0.75

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError("base_s and cap_s must be >= 0 seconds")
        if not 0 <= self.jitter_low <= 1:
            raise ValueError(f"jitter_low must be in [0, 1], got {self.jitter_low}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        return min(self.base_s * 2.0**attempt, self.cap_s) * rng.uniform(self.jitter_low, 1.0)


class HealthStatus(msgspec.Struct, frozen=True):
    ok: bool
    incarnation: str | None = None
    detail: str = ""


def base_url(address: str) -> str:
    """Accept SGLang's ``host:port`` bootstrap address or a full ``http://`` URL."""
    address = address.strip().rstrip("/")
    if not address:
        raise ValueError("the bootstrap address is empty; give host:port")
    return address if "://" in address else f"http://{address}"


class BootstrapClient:
    """One bootstrap server. Use as ``async with BootstrapClient(...) as client``."""

    def __init__(
        self,
        address: str,
        *,
        rng: random.Random,
        token: str | None = None,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - immutable
        timeout_s: float = 5.0,
        health_connect_s: float = 2.0,
        health_read_s: float = 3.0,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = base_url(address)
        self.rng = rng
        self.retry = retry
        self._sleep = sleep
        self._clock = clock
        self._health_timeout = httpx.Timeout(health_read_s, connect=health_connect_s)
        self._health_budget_s = health_connect_s + health_read_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._request_budget_s = timeout_s
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, headers=headers,
                                       transport=transport, verify=_tls_context())  # fmt: skip
        # For a probe's one retry: a client that keeps no connection, so the retry cannot pick
        # another idle (and maybe just as stale) connection from the pool.
        self._unpooled = httpx.AsyncClient(
            base_url=self.url, headers=headers, transport=transport, verify=_tls_context(),
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._topology: tuple[str | None, PrefillServerInfo] | None = None

    async def __aenter__(self) -> BootstrapClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._unpooled.aclose()

    # ---- prefill side ----------------------------------------------------------------------
    async def register_rank(self, registration: RegisterRank) -> None:
        """``PUT /route``. The token travels in a header, never in the body."""
        body = {
            key: value
            for key, value in msgspec.to_builtins(registration).items()
            if key not in ("type", "token") and value is not None
        }
        await self._write("PUT", "/route", body, what="rank registration")

    async def register_dp_rank(self, room: int, dp_rank: int) -> None:
        body = {"bootstrap_room": room, "dp_rank": dp_rank}
        await self._write("POST", "/register_dp_rank", body, what="dp rank registration")

    # ---- decode side -----------------------------------------------------------------------
    async def get_topology(self, *, deadline_s: float = 30.0) -> PrefillServerInfo:
        """The prefill's parallel layout, waiting up to ``deadline_s`` for it to be ready."""
        response = await self._read_route((-1, -1, -1, -1), deadline_s, "topology")
        info: PrefillServerInfo = _decode(response, PrefillServerInfo, "topology")
        self._topology = (response.headers.get(INCARNATION_HEADER), info)
        return info

    async def topology(
        self, incarnation: str | None = None, *, deadline_s: float = 30.0
    ) -> PrefillServerInfo:
        """The cached topology if it was read from this incarnation of the server, else fetch.

        Pass the incarnation the last :meth:`health` reported: a restarted prefill has a new
        one, so its topology is read again.
        """
        if self._topology is not None and self._topology[0] == incarnation:
            return self._topology[1]
        return await self.get_topology(deadline_s=deadline_s)

    def known_topology(self) -> PrefillServerInfo | None:
        """The topology last read, without asking the server."""
        return None if self._topology is None else self._topology[1]

    def forget_topology(self) -> None:
        """Drop the cached topology (e.g. the heartbeat declared the prefill dead)."""
        self._topology = None

    async def get_rank(
        self, dp: int, cp: int, tp: int, pp: int, *, deadline_s: float = 0.0
    ) -> PrefillRankInfo:
        """One prefill rank's control endpoint (and incarnation, from a pdflow server)."""
        response = await self._read_route((dp, cp, tp, pp), deadline_s, "rank")
        rank: PrefillRankInfo = _decode(response, PrefillRankInfo, "rank answer")
        return rank

    async def query_dp_ranks(self, rooms: Iterable[int]) -> dict[int, int]:
        """The prefill dp rank of each room the server still knows; unknown rooms are absent."""
        body = {"bootstrap_rooms": list(rooms)}
        response = await self._once("POST", "/query_dp_ranks", body)
        _raise_for(response, "dp rank query")
        answer: dict[str, int] = _decode(response, dict[str, int], "dp rank answer")
        try:
            return {int(room): dp for room, dp in answer.items()}
        except ValueError:
            raise BootstrapError(f"malformed dp rank answer from {self.url}: {answer}") from None

    async def health(self) -> HealthStatus:
        """``GET /health`` with short timeouts; never raises for an unreachable server.

        A probe dropped unanswered is tried once more on a new connection: the server may only
        have closed the idle keep-alive connection the probe went out on (a live prefill was
        reported down so in CI). A timeout is not retried: that is a paused or overloaded
        server, and a retry would double the time the heartbeat takes to notice it. The retry
        only gets what is left of one probe's time (connect + read timeouts), so a probe never
        takes longer than a probe without a retry could. That time bounds the whole probe, not
        each read: a server dripping its answer a byte at a time fails it."""
        dropped: Exception | None = None
        with anyio.move_on_after(self._health_budget_s):  # the retry gets what is left of it
            try:
                try:
                    response = await self._http.get("/health", timeout=self._health_timeout)
                except _DROPPED_UNANSWERED as exc:
                    log.info("health_probe_retried", url=self.url, error=type(exc).__name__)
                    dropped = exc
                    response = await self._unpooled.get("/health", timeout=self._health_timeout)
            except httpx.HTTPError as exc:
                return HealthStatus(False, None, f"{type(exc).__name__}: {exc}")
            return _health_status(response)
        if dropped is not None:
            return HealthStatus(False, None, f"{type(dropped).__name__}: {dropped}; the retry on "
                                             f"a new connection got no answer within "
                                             f"{self._health_budget_s:g}s of the probe")
        return HealthStatus(False, None, f"no complete answer within {self._health_budget_s:g}s "
                                         "(the probe's deadline): the server is too slow")

    # ---- plumbing --------------------------------------------------------------------------
    async def _once(self, method: str, path: str, body: Any = None,
                    params: dict[str, int] | None = None) -> httpx.Response:
        try:
            with anyio.fail_after(self._request_budget_s):
                return await self._http.request(method, path, json=body, params=params)
        except httpx.TransportError as exc:
            raise BootstrapUnavailable(
                f"cannot reach the bootstrap server at {self.url}: {type(exc).__name__}: {exc}"
            ) from exc
        except TimeoutError:
            raise BootstrapUnavailable(
                f"no complete answer from the bootstrap server at {self.url} to {method} {path} "
                f"within {self._request_budget_s:g}s"
            ) from None

    async def _write(self, method: str, path: str, body: Any, *, what: str) -> None:
        last = ""
        for attempt in range(self.retry.attempts):
            try:
                response = await self._once(method, path, body)
            except BootstrapUnavailable as exc:
                last = str(exc)
            else:
                if response.status_code not in _RETRYABLE_STATUS:
                    _raise_for(response, what)
                    return
                last = f"{response.status_code}: {response.text}"
            if attempt + 1 < self.retry.attempts:
                delay = self.retry.delay(attempt, self.rng)
                log.info("bootstrap_retry", what=what, url=self.url, attempt=attempt + 1,
                         delay_s=round(delay, 3), last=last)
                await self._sleep(delay)
        raise BootstrapUnavailable(
            f"{what} to {self.url} failed after {self.retry.attempts} attempts; last: {last}. "
            "Is the bootstrap server up and reachable?"
        )

    async def _read_route(
        self, ranks: tuple[int, int, int, int], deadline_s: float, what: str
    ) -> httpx.Response:
        params = dict(zip(_ROUTE_PARAMS, ranks, strict=True))
        give_up_at = self._clock() + deadline_s
        attempt = 0
        while True:
            try:
                response = await self._once("GET", "/route", params=params)
            except BootstrapUnavailable as exc:
                last, status, text = str(exc), None, ""
            else:
                if response.status_code != 503:
                    _raise_for(response, what)
                    return response
                last, status, text = f"503: {response.text}", 503, response.text
            remaining = give_up_at - self._clock()
            if remaining <= 0:
                raise BootstrapUnavailable(
                    f"{what} from {self.url} not available within {deadline_s:g}s; last: "
                    f"{last}. Is every prefill rank up and registered?",
                    status=status, body=text,
                )
            await self._sleep(min(self.retry.delay(attempt, self.rng), remaining))
            attempt += 1


def _health_status(response: httpx.Response) -> HealthStatus:
    return HealthStatus(
        response.status_code == 200,
        response.headers.get(INCARNATION_HEADER),
        "" if response.status_code == 200 else f"{response.status_code}: {response.text}",
    )


def _raise_for(response: httpx.Response, what: str) -> None:
    if response.status_code == 200:
        return
    kind = RankNotFound if response.status_code == 404 else BootstrapError
    raise kind(
        f"{what} refused by {response.request.url}: {response.status_code} {response.text}",
        status=response.status_code, body=response.text,
    )


def _decode(response: httpx.Response, kind: Any, what: str) -> Any:
    try:
        return msgspec.json.decode(response.content, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BootstrapError(f"malformed {what} from {response.request.url}: {exc}",
                             status=response.status_code, body=response.text) from exc
