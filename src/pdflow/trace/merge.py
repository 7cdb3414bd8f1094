"""Load trace files of one deployment (or one simulated world) and merge them into one order.

The merged order is a topological order of two relations: each endpoint's records in seq order,
and a record that received a message (``Received.msg_id``) after the record that sent it. Among
records free to go next, the earliest time goes first (ties: file, then line), so a single
simulator file comes back in its own order and processes on one host interleave by their shared
monotonic clock.
"""

from __future__ import annotations

import gc
import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pdflow.core.endpoints.endpoint_io import Received
from pdflow.trace.format import (
    StepRecord,
    TraceHeader,
    encode_sorted,
    parse_message_id,
    read_trace,
)


class TraceMergeError(ValueError):
    """The files do not form one consistent trace; the message says which file and why."""


@dataclass
class Trace:
    headers: dict[str, TraceHeader]
    """By endpoint id, in order of first appearance."""
    records: list[StepRecord]
    """Merged order."""
    gaps: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Endpoints whose records are not contiguous from seq 0: (first missing seq, next present)."""
    torn: list[str] = field(default_factory=list)
    """Torn last lines dropped (a process that died mid-write), one description each."""
    backwards: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Endpoints whose clock went back between consecutive records: (the later record's seq,
    its t, the t before it). Neither clock ever goes back, so the file was spliced or edited."""
    absent_senders: dict[str, int] = field(default_factory=dict)
    """Endpoints with no header in the files that sent messages received here: how many."""
    cut_short: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Endpoints whose records end before a record that sent a message received here: (the
    last seq present, the latest seq a received message names)."""

    def of(self, endpoint: str) -> list[StepRecord]:
        return [r for r in self.records if r.endpoint == endpoint]


_Key = tuple[str, int]  # (endpoint, seq)
_Order = tuple[float, int, int]  # (t, file index, line index)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Building or replaying ~10^5 records makes millions of acyclic objects; the cyclic GC would
    rescan them all again and again (decoding got 5x slower), and none of them need it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_traces(paths: Sequence[Path]) -> Trace:
    if not paths:
        raise TraceMergeError("no trace files given")
    with paused_gc():
        return _load(paths)


def _load(paths: Sequence[Path]) -> Trace:
    headers: dict[str, TraceHeader] = {}
    records: dict[_Key, tuple[_Order, StepRecord]] = {}
    torn: list[str] = []
    for file_index, path in enumerate(paths):
        lines_read = 0
        for line_index, line in enumerate(read_trace(path, torn)):
            lines_read += 1
            if isinstance(line, TraceHeader):
                _add_header(headers, line, path)
                continue
            if line.endpoint not in headers:
                raise TraceMergeError(
                    f"{path}: record seq {line.seq} of endpoint {line.endpoint} comes before "
                    "its header; the file is not a pdflow trace or was cut at the top"
                )
            key = (line.endpoint, line.seq)
            previous = records.get(key)
            if previous is not None:
                if previous[1] != line:
                    raise TraceMergeError(
                        f"{path}: endpoint {line.endpoint} seq {line.seq} appears twice with "
                        "different content; were two runs written to the same trace name?"
                    )
                continue  # the same file (or a copy of it) given twice
            records[key] = ((line.t, file_index, line_index), line)
        if not lines_read:
            # One empty file among good ones must not pass as a clean incident either.
            raise TraceMergeError(
                f"{path}: no pdflow trace header; the file is empty or not a trace (a node "
                "with PDFLOW_TRACE=0 writes none); leave it out or give the right file"
            )
    absent, cut_short = _check_messages(headers, records)
    return Trace(headers, merge_records(records), _gaps(headers, records), torn,
                 _clock_going_back(records), absent, cut_short)  # fmt: skip


def merge_records(records: dict[_Key, tuple[_Order, StepRecord]]) -> list[StepRecord]:
    """Kahn's algorithm over per-endpoint order and message edges, earliest-first."""
    next_of: dict[_Key, _Key] = {}
    by_endpoint: dict[str, list[int]] = {}
    for endpoint, seq in records:
        by_endpoint.setdefault(endpoint, []).append(seq)
    waiting_on: dict[_Key, int] = {}
    for endpoint, seqs in by_endpoint.items():
        seqs.sort()
        for earlier, later in itertools.pairwise(seqs):
            next_of[(endpoint, earlier)] = (endpoint, later)
            waiting_on[(endpoint, later)] = 1
    receivers: dict[_Key, list[_Key]] = {}
    for key, (_, record) in records.items():
        sender = _sender_of(record)
        if sender is not None and sender in records and sender != key:
            receivers.setdefault(sender, []).append(key)
            waiting_on[key] = waiting_on.get(key, 0) + 1
    ready = [(order, key) for key, (order, _) in records.items() if key not in waiting_on]
    heapq.heapify(ready)
    merged: list[StepRecord] = []
    while ready:
        _, key = heapq.heappop(ready)
        merged.append(records[key][1])
        unblocked = receivers.get(key, [])
        following = next_of.get(key)
        for after in [following, *unblocked] if following is not None else unblocked:
            waiting_on[after] -= 1
            if waiting_on[after] == 0:
                heapq.heappush(ready, (records[after][0], after))
    if len(merged) != len(records):
        stuck = sorted(key for key, count in waiting_on.items() if count)[:3]
        raise TraceMergeError(
            f"message ids form a cycle (e.g. at {stuck}); a msg_id names a record that was "
            "sent after it was received, so the trace is corrupt"
        )
    return merged


def _sender_of(record: StepRecord) -> tuple[str, int] | None:
    inp = record.input
    if not isinstance(inp, Received) or inp.msg_id is None:
        return None
    try:
        endpoint, seq, _ = parse_message_id(inp.msg_id)
    except ValueError:
        return None  # a foreign id: it orders nothing
    return endpoint, seq


def _check_messages(
    headers: dict[str, TraceHeader], records: dict[_Key, tuple[_Order, StepRecord]]
) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """Every received message whose sending record is here must be what that record sent:
    otherwise the files come from different runs or were edited (refused, naming the earliest
    such receipt). Messages whose sender is absent are counted for a warning: per endpoint
    without a file, and per endpoint whose records end before the one that sent them."""
    last_seq: dict[str, int] = {}
    for endpoint, seq in records:
        last_seq[endpoint] = max(seq, last_seq.get(endpoint, -1))
    absent: dict[str, int] = {}
    latest_named: dict[str, int] = {}
    receipts = sorted((order, record) for order, record in records.values()
                      if isinstance(record.input, Received) and record.input.msg_id)  # fmt: skip
    for _, record in receipts:
        received = record.input
        assert isinstance(received, Received) and received.msg_id is not None
        try:
            sender, seq, index = parse_message_id(received.msg_id)
        except ValueError:
            continue  # a foreign id (not pdflow's shell): nothing to match it with
        if sender not in headers:
            absent[sender] = absent.get(sender, 0) + 1
            continue
        sent = records.get((sender, seq))
        if sent is None:
            if seq > last_seq.get(sender, -1):
                latest_named[sender] = max(seq, latest_named.get(sender, -1))
            continue  # inside a gap: the gap is reported on its own
        problem = _sent_message_problem(sent[1], index, received)
        if problem:
            raise TraceMergeError(
                f"endpoint {record.endpoint} seq {record.seq} received message {received.msg_id}"
                f" but {sender} seq {seq} {problem}; the files come from different runs under "
                "the same endpoint ids, or one was edited: give the files of one run as its "
                "nodes wrote them"
            )
    cut_short = {sender: (last_seq.get(sender, -1), named)
                 for sender, named in latest_named.items()}  # fmt: skip
    return absent, cut_short


def _sent_message_problem(sender: StepRecord, index: int, received: Received) -> str | None:
    if index >= len(sender.outputs) or sender.outputs[index].get("type") != "send":
        return f"has no message as its output {index}"
    if encode_sorted(sender.outputs[index].get("message")) != encode_sorted(received.message):
        return f"sent another message as its output {index}"
    return None


def _add_header(headers: dict[str, TraceHeader], header: TraceHeader, path: Path) -> None:
    known = headers.get(header.endpoint)
    if known is None:
        headers[header.endpoint] = header
    elif _identity(known) != _identity(header):
        raise TraceMergeError(
            f"{path}: two different endpoints are named {header.endpoint} "
            "(another configuration or spec); give each process its own endpoint id"
        )


def _identity(header: TraceHeader) -> tuple[object, ...]:
    # wall_start differs between rotated segments of one run; it is for humans only.
    return (header.role, header.config, header.spec_sha256, header.clock, header.seed)


def _clock_going_back(
    records: dict[_Key, tuple[_Order, StepRecord]],
) -> dict[str, tuple[int, float, float]]:
    """The first place, per endpoint in seq order, where a record's t is below the one before."""
    last: dict[str, tuple[int, float]] = {}
    found: dict[str, tuple[int, float, float]] = {}
    for endpoint, seq in sorted(records):
        t = records[(endpoint, seq)][1].t
        before = last.get(endpoint)
        if before is not None and t < before[1] and endpoint not in found:
            found[endpoint] = (seq, t, before[1])
        last[endpoint] = (seq, t)
    return found


def _gaps(headers: Iterable[str], records: Iterable[_Key]) -> dict[str, tuple[int, int]]:
    present: dict[str, list[int]] = {endpoint: [] for endpoint in headers}
    for endpoint, seq in records:
        present[endpoint].append(seq)
    gaps: dict[str, tuple[int, int]] = {}
    for endpoint, seqs in present.items():
        seqs.sort()
        for expected, seq in enumerate(seqs):
            if seq != expected:
                gaps[endpoint] = (expected, seq)
                break
    return gaps
