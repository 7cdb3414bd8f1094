"""Receiver process for the Mooncake integration tests.

Opens a Mooncake TCP engine on loopback, registers one zeroed buffer of `--size` bytes and
prints one JSON line: {"session_id": ..., "addr": ..., "size": ...}. Then it answers commands
read from stdin, one per line, each with one JSON line on stdout:

    sha256 OFFSET LENGTH  -> {"sha256": hex digest of buffer[OFFSET:OFFSET+LENGTH]}
    exit                  -> {"bye": true}, then the process ends
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys

from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, required=True)
    args = parser.parse_args()
    buffer = ctypes.create_string_buffer(args.size)
    addr = ctypes.addressof(buffer)
    transport = MooncakeTransport.open(MooncakeConfig(host="127.0.0.1", protocol="tcp"))
    transport.register_buffer(addr, args.size)
    print(json.dumps({"session_id": transport.session_id, "addr": addr, "size": args.size}))
    sys.stdout.flush()
    for line in sys.stdin:
        command, *fields = line.split()
        if command == "sha256":
            offset, length = (int(field) for field in fields)
            if offset < 0 or offset + length > args.size:
                reply: dict[str, object] = {"error": f"range {offset}+{length} out of buffer"}
            else:
                data = ctypes.string_at(addr + offset, length)
                reply = {"sha256": hashlib.sha256(data).hexdigest()}
        elif command == "exit":
            print(json.dumps({"bye": True}), flush=True)
            return 0
        else:
            reply = {"error": f"unknown command {command!r}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
