"""Peer process for the Mooncake integration tests (a receiver, or a writer to pause).

Opens a Mooncake TCP engine on loopback, registers one buffer of `--size` bytes (zeroed, or
every byte `--fill`) and prints one JSON line: {"session_id": ..., "addr": ..., "size": ...}.
Then it answers commands read from stdin, one per line, each with one JSON line on stdout:

    sha256 OFFSET LENGTH          -> {"sha256": hex digest of buffer[OFFSET:OFFSET+LENGTH]}
    write PEER DST_ADDR LENGTH    -> {"ok": ..., "nbytes": ..., "error": ...}: one write of the
                                     buffer's first LENGTH bytes to DST_ADDR at session PEER
    exit                          -> {"bye": true}, then the process ends
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
from typing import NamedTuple

import anyio
import anyio.to_thread

from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport


class Write(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


def reply(fields: dict[str, object]) -> None:
    print(json.dumps(fields), flush=True)


async def serve(size: int, fill: int) -> None:
    buffer = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(buffer)
    ctypes.memset(addr, fill, size)
    transport = MooncakeTransport.open(MooncakeConfig(host="127.0.0.1", protocol="tcp"))
    transport.register_buffer(addr, size)
    reply({"session_id": transport.session_id, "addr": addr, "size": size})
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        command, *fields = line.split()
        if command == "sha256":
            offset, length = (int(field) for field in fields)
            if offset < 0 or offset + length > size:
                reply({"error": f"range {offset}+{length} out of buffer"})
            else:
                data = ctypes.string_at(addr + offset, length)
                reply({"sha256": hashlib.sha256(data).hexdigest()})
        elif command == "write":
            peer, dst_addr, length = fields[0], int(fields[1]), int(fields[2])
            outcome = await transport.batch_write(peer, [Write(addr, dst_addr, length)])
            reply({"ok": outcome.ok, "nbytes": outcome.nbytes, "error": outcome.error})
        elif command == "exit":
            reply({"bye": True})
            return
        else:
            reply({"error": f"unknown command {command!r}"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--fill", type=int, default=0)
    args = parser.parse_args()
    anyio.run(serve, args.size, args.fill, backend="asyncio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
