"""Mooncake Transfer Engine transport (TCP here, RDMA in production).

Each op is submitted as its own engine transfer (`transfer_submit_write`) and polled to a
terminal state (`transfer_check_status`), with at most `max_outstanding_ops` submitted at once
per call. Why not one `batch_transfer_sync_write` per batch:

- the engine reports a batch FAILED as soon as one op fails, while its sibling ops may still be
  on the wire; per-op tracking lets `batch_write` return only once every submitted op is
  settled, which is what makes `close_session` a real fence;
- the TCP transport rejects ops beyond a per-peer queue (about 2048 ops measured here; a batch
  of 4096 x 4 KiB fails), and the window keeps us under it without splitting by guesswork;
- measured on loopback it is as fast as the engine's batch call (see benchmarks/transport_raw).

Engine calls block, so they run in worker threads under a `CapacityLimiter`. A worker is never
abandoned on cancellation: cancelling `batch_write` waits for the engine to settle its ops.

No receiver-side fence (`fence_is_real` is False). Over TCP the receiving engine checks a
request's destination range against its registered buffers once, when the request header
arrives (`ServerSession::readHeader` calls `validateTcpAddress`), then streams the body straight
into that memory in `MC_TCP_SLICE_SIZE` (64 KiB) reads with no further check
(`ServerSession::readBody`, tcp_transport_session_impl.h). The server keeps no table of its
sessions, the header names no sender, and the Python binding has no call that drops a peer's
connections or removes its endpoint. So unregistering a buffer refuses only requests whose
header arrives later, and a paused writer's accepted request lands when it resumes
(tests/integration/test_mooncake_transport.py shows it). Over RDMA the mechanism exists in the
engine (docs/operations.md, "Fencing a dead writer") but the binding does not expose it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from pdflow.transport.base import RegistrationError, TransferOutcome, TransportError
from pdflow.transport.guarded import CheckedWrite, GuardedTransport

SUPPORTED_PROTOCOLS = ("tcp", "rdma")
_STATUS_COMPLETED = 1
_STATUS_FAILED = -1
# Idle pause between status sweeps that saw no progress; short next to one 4 KiB op (~60 us).
_POLL_PAUSE_S = 20e-6


class MooncakeConfig(msgspec.Struct, frozen=True):
    """Where and how the engine listens. `protocol` is "tcp" (tests) or "rdma" (production)."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    device_name: str = ""
    max_concurrent_calls: int = 2
    max_outstanding_ops: int = 512


def load_engine_class() -> Any:
    """Import Mooncake's `TransferEngine`, keeping only its errors unless MC_LOG_LEVEL is set."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(
            "Mooncake is not installed: run scripts/setup.sh (installs "
            "mooncake-transfer-engine-non-cuda and libibverbs1/librdmacm1)"
        ) from exc
    return TransferEngine


def _is_batch_id(handle: int) -> bool:
    # The binding signals a refused submit with 0 or with -1 wrapped to an unsigned 64-bit int.
    return 0 < handle < 2**64 - 1


class MooncakeTransport(GuardedTransport):
    """A pdflow `Transport` over one Mooncake `TransferEngine`; build with `open()`."""

    def __init__(self, engine: Any, session_id: str, config: MooncakeConfig) -> None:
        super().__init__()
        self._engine = engine
        self._session_id = session_id
        self._config = config
        self._limiter = anyio.CapacityLimiter(config.max_concurrent_calls)

    @classmethod
    def open(cls, config: MooncakeConfig | None = None) -> MooncakeTransport:
        """Start an engine listening on `config.host`; its session id is "host:rpc_port"."""
        config = config or MooncakeConfig()
        if config.protocol not in SUPPORTED_PROTOCOLS:
            raise TransportError(
                f"unsupported Mooncake protocol {config.protocol!r}; use one of "
                f"{', '.join(SUPPORTED_PROTOCOLS)}"
            )
        if config.max_concurrent_calls < 1 or config.max_outstanding_ops < 1:
            raise TransportError("max_concurrent_calls and max_outstanding_ops must be >= 1")
        engine = load_engine_class()()
        status = engine.initialize(
            config.host, config.metadata_server, config.protocol, config.device_name
        )
        if status != 0:
            raise TransportError(
                f"Mooncake engine failed to initialise (status {status}) on host "
                f"{config.host!r} with protocol {config.protocol!r}; check the host address "
                "and, for rdma, that RDMA devices are present"
            )
        return cls(engine, f"{config.host}:{engine.get_rpc_port()}", config)

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def config(self) -> MooncakeConfig:
        return self._config

    @property
    def fence_is_real(self) -> bool:
        """False: nothing reachable from here stops a peer's accepted write (module docstring)."""
        return False

    def _engine_register(self, addr: int, length: int) -> None:
        status = self._engine.register_memory(addr, length)
        if status != 0:
            raise RegistrationError(
                f"Mooncake refused to register [{addr:#x}, +{length}) (status {status})"
            )

    def _engine_unregister(self, addr: int) -> None:
        status = self._engine.unregister_memory(addr)
        if status != 0:
            raise RegistrationError(f"Mooncake refused to unregister {addr:#x} (status {status})")

    async def _engine_write(self, peer: str, writes: Sequence[CheckedWrite]) -> TransferOutcome:
        return await anyio.to_thread.run_sync(
            self._write_settled, peer, writes, limiter=self._limiter, abandon_on_cancel=False
        )

    def _write_settled(self, peer: str, writes: Sequence[CheckedWrite]) -> TransferOutcome:
        """Submit through a bounded window and poll until every submitted op is settled.

        After the first failure no further op is submitted, but those already submitted are
        still awaited: returning earlier would let them land after a `close_session`.
        """
        engine = self._engine
        window = self._config.max_outstanding_ops
        pending: list[tuple[int, int]] = []  # (engine batch id, op index)
        failed: list[int] = []
        landed_ops = landed_bytes = next_index = 0
        started = time.perf_counter()
        while pending or (next_index < len(writes) and not failed):
            while next_index < len(writes) and len(pending) < window and not failed:
                write = writes[next_index]
                handle = engine.transfer_submit_write(
                    peer, write.src_addr, write.dst_addr, write.length
                )
                if _is_batch_id(handle):
                    pending.append((handle, next_index))
                else:
                    failed.append(next_index)
                next_index += 1
            still_pending: list[tuple[int, int]] = []
            for handle, index in pending:
                status = engine.transfer_check_status(handle)
                if status == _STATUS_COMPLETED:
                    landed_ops += 1
                    landed_bytes += writes[index].length
                elif status == _STATUS_FAILED:
                    failed.append(index)
                else:  # waiting, or a timeout report while the op is still on the wire
                    still_pending.append((handle, index))
            if len(still_pending) == len(pending) and still_pending:
                time.sleep(_POLL_PAUSE_S)
            pending = still_pending
        seconds = time.perf_counter() - started
        if not failed:
            return TransferOutcome(ok=True, nbytes=landed_bytes, nops=landed_ops, seconds=seconds)
        first = writes[min(failed)]
        return TransferOutcome(
            ok=False,
            nbytes=landed_bytes,
            nops=landed_ops,
            seconds=seconds,
            error=(
                f"{len(failed)} of {len(writes)} ops failed and {len(writes) - next_index} were "
                f"not submitted; first failed op {min(failed)} wrote [{first.dst_addr:#x}, "
                f"+{first.length}) at {peer}: the peer is unreachable or that range is not "
                "registered there"
            ),
        )

    async def _engine_shutdown(self) -> None:
        # Dropping the last reference runs the engine's destructor, which joins its threads
        # and takes about a second; let a worker thread pay for it, not the event loop.
        holder = [self._engine]
        self._engine = None
        await anyio.to_thread.run_sync(holder.clear, limiter=self._limiter)
