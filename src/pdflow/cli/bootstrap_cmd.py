"""`pdflow bootstrap`: run the bootstrap registry on its own until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pdflow.io.settings import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "bootstrap",
        help="run the HTTP bootstrap registry (SGLang-compatible routes) on its own",
        description="Serve the bootstrap registry. Settings not given here come from PDFLOW_* "
        "(and SGLang's) environment variables; PDFLOW_BOOTSTRAP_TOKEN makes registration "
        "require that token.",
    )
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="port to bind (default 8998; 0 picks a free one)")
    parser.add_argument("--dp-rank-ttl", type=float, default=None,
                        help="seconds a room -> dp rank entry lives (default 120)")
    parser.add_argument("--incarnation", default=None,
                        help="report this incarnation in /health (default: none). Leave it "
                             "unset for a registry standing apart from the prefill: decodes "
                             "read a changed incarnation as a restarted prefill")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import anyio

    from pdflow.io.settings import SettingsError, load_settings

    try:
        settings = load_settings(host=args.host, bootstrap_port=args.port,
                                 dp_rank_ttl=args.dp_rank_ttl)
    except SettingsError as exc:
        print(f"pdflow bootstrap: {exc}", file=sys.stderr)
        return 2
    _log_json_to(sys.stderr)
    _raise_open_files_limit()
    incarnation = args.incarnation
    try:
        anyio.run(_serve_until_signalled, settings, incarnation, backend="asyncio")
    except OSError as exc:
        print(f"pdflow bootstrap: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signalled(settings: Settings, incarnation: str | None) -> None:
    import anyio
    import structlog

    from pdflow.io.bootstrap_server import serve

    log = structlog.get_logger("pdflow.bootstrap")
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with serve(
            settings.host,
            settings.bootstrap_port,
            token=settings.bootstrap_token,
            incarnation=incarnation,
            dp_rank_ttl=settings.dp_rank_ttl,
            max_body=settings.bootstrap_max_body,
        ) as server:
            print(f"pdflow bootstrap listening on {server.url}", flush=True)
            async for signum in signals:
                log.info("bootstrap_stopping", signal=signal.Signals(signum).name)
                break


def _raise_open_files_limit(wanted: int = 65536) -> None:
    """A registry on its own holds a connection per client rank, and caps its connections at an
    eighth of ``ulimit -n`` (asgi_serving.connection_cap): a soft limit of 1,024 would leave it
    128. Raised towards the hard limit, as servers of this kind (and SGLang's launcher) do."""
    import contextlib
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        # Refused: kept as it is, and the cap follows whatever limit the process has.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _log_json_to(stream: TextIO) -> None:
    """One JSON object a line. An exception logged with ``exc_info`` gets its traceback as text
    (``exception``): format_exc_info, not dict_tracebacks, whose frames carry their local
    variables (a request's token among them)."""
    import structlog

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(stream),
    )
