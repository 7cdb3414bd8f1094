"""Node fuzzer: hostile frames at the control sockets of a running prefill and decode.

Both nodes run in a background event loop; Hypothesis sends half of ``PDFLOW_FUZZ_EXAMPLES``
frame lists (5,000 in CI: 2,500 with the token set, 2,500 without) each to one of the three
control sockets. Afterwards: every frame
was dropped and counted, no endpoint's state changed, a normal room still succeeds with its
bytes verified (checksums on), and the process grew by at most FD_BOUND descriptors and
RSS_BOUND bytes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio.from_thread
import pytest
import zmq
from hypothesis import assume, given
from hypothesis import strategies as st

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.codec import FrameError, MsgpackCodec
from pdflow.io.node_decode import DecodeNode
from pdflow.io.node_prefill import PrefillNode
from pdflow.io.settings import load_settings
from tests.integration.test_hostile_input import rss_bytes
from tests.integration.test_nodes_inprocess import one_room, two_nodes
from tests.property.frame_strategies import (
    FRAME_LISTS,
    FUZZ_EXAMPLES,
    errors_only,
    fuzz_settings,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FD_BOUND = 16
RSS_BOUND = 48 << 20
TOKEN = "fuzz-cluster-token"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def dropped(node: PrefillNode | DecodeNode) -> float:
    return sum(sample.value for metric in node.runtime.metrics.registry.collect()
               if metric.name == "pdflow_dropped_frames" for sample in metric.samples
               if sample.name.endswith("_total"))  # fmt: skip


@contextmanager
def running_nodes(tmp_path: Path, token: str | None) -> Iterator[
        tuple[anyio.from_thread.BlockingPortal, PrefillNode, DecodeNode]]:  # fmt: skip
    settings = load_settings(env={}, trace_dir=str(tmp_path), checksum=True,
                             bootstrap_token=token)  # fmt: skip
    with (
        anyio.from_thread.start_blocking_portal("asyncio") as portal,
        portal.wrap_async_context_manager(two_nodes(settings)) as (p_node, d_node),
    ):
        # A first room: the decode is announced, every lazy import and socket exists.
        assert portal.call(one_room, p_node, d_node, 1) is KVPoll.Success
        yield portal, p_node, d_node


def fuzz_control_sockets(tmp_path: Path, token: str | None) -> None:
    with running_nodes(tmp_path, token) as (portal, p_node, d_node):
        nodes = (p_node, d_node)
        targets = [rank.peer.address for node in nodes for rank in node.ranks]
        context = zmq.Context()
        pushes = []
        for address in targets:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 5000)
            push.connect(f"tcp://{address}")
            pushes.append(push)
        plain = MsgpackCodec()
        sent = 0
        dry = True  # the first pass only generates: Hypothesis's own caches are not the node's

        @fuzz_settings(FUZZ_EXAMPLES // 2)
        @given(frames=FRAME_LISTS, target=st.integers(0, len(targets) - 1))
        def send(frames: list[bytes], target: int) -> None:
            nonlocal sent
            if token is None:
                # Without a token a valid message is taken (and may park): send only frames
                # the codec refuses. With the token nothing without a valid MAC gets through.
                try:
                    plain.decode(frames)
                    assume(False)
                except FrameError:
                    pass
            if dry:
                return
            pushes[target].send_multipart(frames or [b""])
            sent += 1

        try:
            send()
            dry = False
            snapshots = portal.call(lambda: [r.snapshot() for n in nodes for r in n.ranks])
            fds, rss = open_fds(), rss_bytes()
            drops_before = sum(dropped(node) for node in nodes)
            with errors_only():
                send()
        finally:
            for push in pushes:
                push.close()
            context.term()
        give_up = time.monotonic() + 60
        while sum(dropped(node) for node in nodes) - drops_before < sent:
            assert time.monotonic() < give_up, "frames were neither delivered nor counted"
            time.sleep(0.05)
        assert sum(dropped(node) for node in nodes) - drops_before == sent
        assert portal.call(lambda: [r.snapshot() for n in nodes for r in n.ranks]) == snapshots
        assert portal.call(one_room, p_node, d_node, 2) is KVPoll.Success
        assert open_fds() - fds <= FD_BOUND
        assert rss_bytes() - rss <= RSS_BOUND, f"RSS grew {(rss_bytes() - rss) >> 20} MiB"
        print(f"fuzzed {sent} frames (token={'set' if token else 'none'})")


def test_fuzzed_frames_change_nothing_on_a_node_with_the_token(tmp_path: Path) -> None:
    fuzz_control_sockets(tmp_path, TOKEN)


def test_fuzzed_undecodable_frames_change_nothing_on_a_node_without_a_token(
    tmp_path: Path,
) -> None:
    fuzz_control_sockets(tmp_path, None)
