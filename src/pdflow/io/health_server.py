"""A prefill process's own health endpoint: ``GET /health`` answers 200 with its incarnation.

It answers 503 (with the incarnation too, and why) while ``wedged()`` names a reason: a rank
whose control step never ends cannot take part in any room, though the process still answers,
so the decode must count it as a failed probe, as it would a paused process.

The decode's heartbeat probes it (the address travels in each rank's registration), so a dead
or paused prefill is noticed even behind an external registry (``pdflow bootstrap``), whose own
``/health`` only says the registry is up. A PrefillNode hosting its registry needs none: the
registry's ``/health`` is served by the same process and carries the same incarnation header.
Another path gets 404, another method 405 (as the registry answers them); idle and slow
connections are cut as for the registry (:class:`pdflow.io.asgi_serving.ServingLimits`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from pdflow.io.asgi_serving import ServingLimits, bind, require_asyncio, serving
from pdflow.io.bootstrap_client import INCARNATION_HEADER

log = structlog.get_logger("pdflow.health")

Wedged = Callable[[], str | None]
"""Why the process is unhealthy now (a wedged rank), or None."""


def healthy() -> str | None:
    """A process with nothing that can wedge: always healthy."""
    return None


class WedgeAnswer:
    """The 503 a wedged process answers its health probes with (logged once per episode)."""

    def __init__(self, incarnation: str | None, wedged: Wedged) -> None:
        self.headers = {INCARNATION_HEADER: incarnation} if incarnation else {}
        self.wedged = wedged
        self._answered = False

    def now(self) -> Response | None:
        """The 503 to answer now, or None when nothing is wedged."""
        reason = self.wedged()
        if reason is not None and not self._answered:
            log.warning("health_unhealthy", reason=reason)
        elif reason is None and self._answered:
            log.info("health_recovered")
        self._answered = reason is not None
        if reason is None:
            return None
        return PlainTextResponse(reason, status_code=503, headers=self.headers)


def health_app(incarnation: str, wedged: Wedged = healthy) -> Starlette:
    wedge = WedgeAnswer(incarnation, wedged)

    async def health(request: Request) -> Response:
        return wedge.now() or PlainTextResponse("OK", headers=wedge.headers)

    async def not_found(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("404: Not Found", status_code=404)

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("Method not allowed", status_code=405)

    return Starlette(routes=[Route("/health", health, methods=["GET"])],
                     exception_handlers={404: not_found, 405: not_allowed})  # fmt: skip


@asynccontextmanager
async def serve_health(
    host: str,
    incarnation: str,
    port: int = 0,
    limits: ServingLimits = ServingLimits(),  # noqa: B008 - immutable
    wedged: Wedged = healthy,
) -> AsyncIterator[str]:
    """Serve the process's health endpoint until the block ends; yields its ``host:port``."""
    require_asyncio("health endpoint")
    listener = bind(host, port, "health endpoint")
    bound_host, bound_port = listener.getsockname()[:2]
    address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
    async with serving(health_app(incarnation, wedged), listener, "health endpoint", limits):
        log.info("health_listening", address=address, incarnation=incarnation)
        yield address
