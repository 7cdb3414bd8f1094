"""SGLang's own prealloc-queue code (``DecodePreallocQueue._resolve_pending_reqs``, built with
``__new__`` as SGLang's unit tests build it) with pdflow's decode manager and receiver: how
quickly a request to a prefill the decode has not met yet gets its receiver initialised; no
processes (the registry's answer is the manager's topology fetch, replaced here)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from sglang.srt.plugins import load_plugins

load_plugins()  # the pdflow plugin's hooks, as in every SGLang process

from sglang.srt.disaggregation.decode import DecodePreallocQueue  # noqa: E402
from sglang.srt.runtime_context import publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from pdflow.core.cluster.registry import PrefillServerInfo  # noqa: E402
from pdflow.sglang.conn import TOPOLOGY_FIRST_WAIT_S, PdflowKVManager  # noqa: E402
from pdflow.sglang.loop import LoopThread  # noqa: E402
from tests_sglang.driver import MODEL_DIR  # noqa: E402

ADDR = "10.0.0.9:8998"
TOPOLOGY = PrefillServerInfo(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1,
                             page_size=4, kv_cache_dtype="auto")  # fmt: skip


@pytest.fixture(autouse=True)
def _published_server_args() -> Any:
    # The queue reads SGLang's published config (its allocation policy), as SGLang's own
    # queue unit tests publish it.
    reset_context()
    publish(ServerArgs(model_path=str(MODEL_DIR), skip_tokenizer_init=True, device="cpu"),
            role="test")  # fmt: skip
    yield
    reset_context()


def _manager(registry_answers_in: float) -> PdflowKVManager:
    """A decode manager with a real loop thread whose registry answers after a delay."""
    mgr = PdflowKVManager.__new__(PdflowKVManager)
    mgr.prefill_info_table, mgr._topology_pending = {}, set()
    mgr.loop = LoopThread("test-prealloc")

    async def fetch(bootstrap_addr: str) -> None:
        try:
            await anyio.sleep(registry_answers_in)
            mgr.prefill_info_table[bootstrap_addr] = TOPOLOGY
        finally:
            mgr._topology_pending.discard(bootstrap_addr)

    mgr._fetch_topology = fetch  # type: ignore[method-assign]
    return mgr


class _Receiver:
    def __init__(self) -> None:
        self.inits: list[int] = []
        self.conclude_state = None

    def init(self, prefill_dp_rank: int) -> None:
        self.inits.append(prefill_dp_rank)


def _queue(mgr: PdflowKVManager, receiver: Any) -> DecodePreallocQueue:
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.kv_manager = mgr
    queue._prefill_dp_rank_queries = {}
    queue._ensure_retry_count, queue._ensure_last_attempt_time = {}, {}
    queue._max_ensure_retries, queue._ensure_retry_interval = 15, 1.0  # SGLang's
    host, port = ADDR.split(":")
    queue.pending_reqs = [SimpleNamespace(
        req=SimpleNamespace(rid="r", bootstrap_host=host, bootstrap_port=int(port),
                            bootstrap_room=7, disagg_prefill_dp_rank=None),
        kv_receiver=receiver, is_rebootstrap=False)]  # fmt: skip
    return queue


def test_first_request_to_a_new_prefill_is_initialised_in_the_same_cycle() -> None:
    # A registry that answers in 20 ms: SGLang's queue must not wait its 1 s retry interval.
    mgr, receiver = _manager(registry_answers_in=0.02), _Receiver()
    queue = _queue(mgr, receiver)
    try:
        queue._resolve_pending_reqs()
        assert receiver.inits == [0] and queue.pending_reqs == []
    finally:
        mgr.loop.close()


def test_an_unanswering_registry_holds_the_scheduler_at_most_the_bound() -> None:
    mgr, receiver = _manager(registry_answers_in=30.0), _Receiver()
    queue = _queue(mgr, receiver)
    try:
        started = time.monotonic()
        queue._resolve_pending_reqs()
        queue._resolve_pending_reqs()  # within SGLang's retry interval: not asked again
        assert time.monotonic() - started < TOPOLOGY_FIRST_WAIT_S + 0.5
        assert receiver.inits == [] and len(queue.pending_reqs) == 1
    finally:
        mgr.loop.close()
