"""Protocol traces: one JSON line per core step, enough to replay every endpoint exactly.

Recording (shell, simulator)::

    recorder = TraceRecorder(path, clock="monotonic", max_bytes=..., backups=3, enabled=True)
    endpoint = recorder.wrap("prefill-0", PrefillEndpoint(config))   # bare endpoint when off
    step = endpoint.handle(inp, now)                                  # recorded, errors too
    msg_id = message_id("prefill-0", endpoint.last_seq, output_index) # put on the wire

Replay and checks: :mod:`pdflow.trace.replay`, :mod:`pdflow.trace.monitor`; docs/trace.md.
"""

from pdflow.trace.format import (
    TRACE_FORMAT_VERSION,
    StepError,
    StepRecord,
    TraceHeader,
    message_id,
    read_trace,
)
from pdflow.trace.recorder import RecordingEndpoint, TraceRecorder

__all__ = [
    "TRACE_FORMAT_VERSION",
    "RecordingEndpoint",
    "StepError",
    "StepRecord",
    "TraceHeader",
    "TraceRecorder",
    "message_id",
    "read_trace",
]
