"""Bootstrap clients share one verifying TLS context: building one (and loading the CA bundle
into it) per client cost the prefill's loop ~0.1 s per heartbeat under load."""

from __future__ import annotations

import random
import ssl

import pytest

from pdflow.io.bootstrap_client import BootstrapClient


def test_clients_load_the_ca_bundle_at_most_once_and_still_verify(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(self)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    clients = [BootstrapClient(address, rng=random.Random(0))
               for address in ("127.0.0.1:1", "127.0.0.1:2", "https://127.0.0.1:3")]  # fmt: skip
    assert len(loads) <= 1, f"{len(loads)} CA bundle loads for {len(clients)} clients"
    for client in clients:
        context = client._http._transport._pool._ssl_context  # type: ignore[attr-defined]
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
