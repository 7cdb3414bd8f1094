"""(c) SGLang's decode release code and the backend contract, in SGLang's own unit-test style
(queues built with ``__new__``, ``release_kv_cache`` patched), with pdflow's manager, receiver
and sender instead of SGLang's ``CommonKVManager``; no processes.

SGLang's own ``test/registered/unit/disaggregation`` files that exercise this code
(``test_deferred_decode_kv_release.py``) build ``CommonKVManager`` ACK trackers, which pdflow
does not have (it tracks writers, not ACK counts), so their scenarios are restated here for the
pdflow backend; see docs/sglang.md for the full list and why the others cannot take a backend.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
from sglang.srt.plugins import load_plugins

load_plugins()  # the pdflow plugin's hooks, as in every SGLang process

from sglang.srt.disaggregation import decode as decode_mod  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402
from sglang.srt.disaggregation.decode import DecodeTransferQueue  # noqa: E402

from pdflow.core.framework.kvpoll import KVPoll as PdflowPoll  # noqa: E402
from pdflow.io.node_common import PagesReleased, RoomClosed, RoomStatus  # noqa: E402
from pdflow.io.node_decode import DecodeNode  # noqa: E402
from pdflow.io.node_prefill import PrefillNode  # noqa: E402
from pdflow.sglang.conn import PdflowKVManager, PdflowKVReceiver, PdflowKVSender  # noqa: E402
from pdflow.sglang.rooms import RoomBook  # noqa: E402


class _IdxAllocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, idx: int) -> None:
        self.freed.append(idx)


def _queue(timeout: float) -> DecodeTransferQueue:
    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    q._deferred_releases = []
    q.deferred_kv_release_timeout = timeout
    q.enable_staging = False
    q.staging_handler = None
    q.enable_host_receive = False
    q.tree_cache = object()
    q.metadata_buffers = SimpleNamespace(bootstrap_room={}, clear_slot=lambda idx: None)
    q.req_to_metadata_buffer_idx_allocator = _IdxAllocator()
    q.scheduler = SimpleNamespace(metrics_reporter=SimpleNamespace(enable_metrics=False),
                                  enable_hisparse=False)  # fmt: skip
    q.gloo_group = None
    return q


class _QueuedOnly:
    """A rank whose calls are only queued (``mgr.run`` records their names), never run."""

    def __getattr__(self, name: str) -> Any:
        return name


def _manager(node_class: type = DecodeNode) -> PdflowKVManager:
    """A pdflow manager whose node never starts: room facts and the queued calls only."""
    mgr = PdflowKVManager.__new__(PdflowKVManager)
    mgr.book = RoomBook()
    mgr.calls = []
    mgr.run = lambda room, name, call, *args: mgr.calls.append((room, name))
    mgr.node = node_class.__new__(node_class)
    mgr.node.ranks = [_QueuedOnly()]
    mgr.rank_kv = SimpleNamespace(state=())  # a pool without model state
    mgr.prefill_info_table = {}
    return mgr


def _decode_req(mgr: PdflowKVManager, room: int, idx: int, *,
                publish: bool = True) -> SimpleNamespace:  # fmt: skip
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", room)
    receiver.init(0)
    if publish:
        receiver.send_metadata([1, 2], idx, None)  # pdflow now has the pages
    receiver.abort()  # what Scheduler.abort_request does for a transfer-queue request
    return SimpleNamespace(req=SimpleNamespace(bootstrap_room=room), kv_receiver=receiver,
                           metadata_buffer_index=idx, host_staged=False)  # fmt: skip


def _released(room: int) -> PagesReleased:
    return PagesReleased(rank=0, room=room, generation=0, pages=(1, 2))


@pytest.fixture(autouse=True)
def _dist_group_of_one() -> Any:
    # resolve_deferred_releases reduces its flags over the gloo group (one rank here).
    with patch.object(decode_mod, "all_reduce_flags", side_effect=lambda flags, **_: flags):
        yield


def test_a_pdflow_room_is_held_past_sglangs_deadline_until_pages_released() -> None:
    mgr, q = _manager(), _queue(timeout=0.0)  # SGLang's deadline is already past
    dreq = _decode_req(mgr, room=200, idx=7)
    assert dreq.kv_receiver.poll() == KVPoll.Failed and dreq.kv_receiver.abort_notified
    q._defer_release(dreq)
    with patch.object(decode_mod, "release_kv_cache") as release:
        q.resolve_deferred_releases()
        q.resolve_deferred_releases()
        release.assert_not_called()
        assert len(q._deferred_releases) == 1
        mgr.book.apply(_released(200))  # pdflow: every writer drained or was fenced
        q.resolve_deferred_releases()
        release.assert_called_once()
    assert q._deferred_releases == []
    assert q.req_to_metadata_buffer_idx_allocator.freed == [7]
    assert dreq.kv_receiver is None
    assert mgr.book.facts(200).poll is None  # the room's facts were forgotten


def test_other_backends_keep_sglangs_deadline() -> None:
    q = _queue(timeout=0.0)
    mgr = SimpleNamespace(is_abort_release_safe=lambda room, acks: False,
                          clear_deferred_abort_state=lambda room: None)  # fmt: skip
    receiver = SimpleNamespace(kv_mgr=mgr, bootstrap_infos=[{}], abort_notified=True,
                               clear=lambda: None)  # fmt: skip
    dreq = SimpleNamespace(req=SimpleNamespace(bootstrap_room=300), kv_receiver=receiver,
                           metadata_buffer_index=3, host_staged=False)  # fmt: skip
    q._defer_release(dreq)
    with patch.object(decode_mod, "release_kv_cache") as release:
        q.resolve_deferred_releases()
        release.assert_called_once()  # SGLang's release-anyway, untouched for mooncake & co.


def test_a_failed_release_is_isolated_and_not_retried() -> None:
    mgr, q = _manager(), _queue(timeout=30.0)
    good, bad = _decode_req(mgr, 700, 1), _decode_req(mgr, 701, 2)
    q._defer_release(bad)
    q._defer_release(good)
    mgr.book.apply(_released(700))
    mgr.book.apply(_released(701))
    calls: list[Any] = []

    def release(req: Any, tree_cache: Any, **_: Any) -> None:
        calls.append(req)
        if req is bad.req:
            raise RuntimeError("boom")

    with patch.object(decode_mod, "release_kv_cache", side_effect=release):
        q.resolve_deferred_releases()
        assert good.req in calls and q._deferred_releases == []
        q.resolve_deferred_releases()
    assert len(calls) == 2


def _sender(room: int) -> PdflowKVSender:
    mgr = _manager(PrefillNode)
    return PdflowKVSender(mgr, "10.0.0.1:8998", room)


def test_the_prefill_reports_failed_only_after_its_writes_drained() -> None:
    sender = _sender(400)
    book = sender.kv_mgr.book
    book.apply(RoomStatus(rank=0, room=400, generation=0, poll=PdflowPoll.Transferring))
    assert sender.poll() == KVPoll.Transferring
    book.apply(RoomStatus(rank=0, room=400, generation=0, poll=PdflowPoll.Failed,
                          reason="decode aborted the room"))  # fmt: skip
    assert sender.poll() == KVPoll.Transferring  # writes may still be in flight
    assert ("clear" in {name for _, name in sender.kv_mgr.calls})  # pdflow drains, then forgets
    book.apply(RoomClosed(rank=0, room=400, generation=0))  # forgotten: nothing in flight
    assert sender.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="decode aborted the room") as raised:
        sender.failure_exception()
    assert raised.value.bootstrap_room == 400


def test_a_poll_answers_each_change_of_the_rooms_facts_and_repeats_the_last_answer() -> None:
    """poll() answers from the room's last facts snapshot without recomputing while it is the
    same one; every new snapshot (a status, a forget, a refusal) gives its own answer."""
    sender = _sender(410)
    receiver = PdflowKVReceiver(_manager(), "10.0.0.1:8998", 411)
    receiver.init(0)
    assert [sender.poll(), sender.poll(), receiver.poll()] == [KVPoll.Bootstrapping] * 3
    for poll in (PdflowPoll.WaitingForInput, PdflowPoll.Transferring):
        sender.kv_mgr.book.apply(RoomStatus(rank=0, room=410, generation=0, poll=poll))
        receiver.kv_mgr.book.apply(RoomStatus(rank=0, room=411, generation=0, poll=poll))
        assert [sender.poll(), sender.poll(), receiver.poll(), receiver.poll()] == [poll] * 4
    sender.kv_mgr.book._rooms.pop(410)  # nothing known: the last live status stays
    assert sender.poll() == KVPoll.Transferring
    receiver.kv_mgr.book.apply(RoomStatus(rank=0, room=411, generation=0,
                                          poll=PdflowPoll.Success))  # fmt: skip
    assert receiver.poll() == KVPoll.Success and receiver.conclude_state == KVPoll.Success
    other = PdflowKVReceiver(receiver.kv_mgr, "10.0.0.1:8998", 412)
    assert other.poll() == KVPoll.Bootstrapping
    other.kv_mgr.book.refuse(412, "pdflow refused open_room: no such prefill")
    assert other.poll() == KVPoll.Failed and other.conclude_state == KVPoll.Failed


def test_a_refused_call_fails_the_receiver_with_the_reason() -> None:
    mgr = _manager()
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", 500)
    receiver.init(0)
    assert receiver.poll() == KVPoll.Bootstrapping
    mgr.book.refuse(500, "pdflow refused publish_pages: page 9 is quarantined")
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="page 9 is quarantined"):
        receiver.failure_exception()


def test_what_pdflow_cannot_receive_fails_the_room_not_the_scheduler() -> None:
    mgr = _manager()
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", 600)
    receiver.init(0)
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    receiver.send_metadata([1, 2], 0, None, destination=KVTransferDestination.HOST)
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="host destinations"):
        receiver.failure_exception()


def test_model_state_between_tp_widths_fails_the_room_with_the_reason() -> None:
    """An SWA pool (whose TP split the adapter does not map) and a prefill of another
    attention TP width: the room fails in send_metadata, naming the state type."""
    import numpy as np

    from pdflow.sglang.layout import state_cross_tp_refusal

    mgr = _manager()
    mgr.rank_kv = SimpleNamespace(state=(object(),), tp_size=1)  # one state component, TP 1
    swa = SimpleNamespace(state_types=[SimpleNamespace(value="swa")], state_data_ptrs=[[1]])
    mgr.state_cross_tp_refusal = state_cross_tp_refusal(swa, 1)
    mgr.prefill_info_table = {"10.0.0.1:8998": SimpleNamespace(attn_tp_size=2)}
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", 601)
    receiver.init(0)
    receiver.send_metadata([1, 2], 0, [[np.asarray(3)]])
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match=r"attention TP widths .* not \['swa'\]"):
        receiver.failure_exception()
    assert [name for _, name in mgr.calls] == ["open_room"]  # no pages published


def test_a_mamba_pool_whose_split_is_known_goes_to_another_tp_width() -> None:
    import numpy as np

    mgr = _manager()
    mgr.rank_kv = SimpleNamespace(state=(object(),), tp_size=1)
    mgr.state_cross_tp_refusal = ""  # state_cross_tp_refusal of a described Mamba pool
    mgr.prefill_info_table = {"10.0.0.1:8998": SimpleNamespace(attn_tp_size=2)}
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", 602)
    receiver.init(0)
    receiver.send_metadata([1, 2], 0, [[np.asarray(3)]])
    assert receiver.poll() != KVPoll.Failed
    assert [name for _, name in mgr.calls] == ["open_room", "publish_pages"]


def test_sglangs_pop_transferred_holds_a_failed_pdflow_room_instead_of_freeing_it() -> None:
    """SGLang's test_decode_queue_cleanup scenario (a failed transfer) through the real
    ``pop_transferred`` with a pdflow receiver: the pages are held, not freed."""
    from unittest.mock import MagicMock

    from sglang.srt.disaggregation.decode import HiCacheRestoreResult

    mgr = _manager()
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", 7)
    receiver.init(0)
    receiver.send_metadata([1, 2], 3, None)
    mgr.book.apply(RoomStatus(rank=0, room=7, generation=0, poll=PdflowPoll.Failed,
                              reason="lost connection with prefill 10.0.0.1:41991"))  # fmt: skip
    req = SimpleNamespace(rid="failed-transfer", bootstrap_room=7, return_logprob=False)
    decode_req = SimpleNamespace(req=req, kv_receiver=receiver, metadata_buffer_index=3,
                                 hicache_restore_status=HiCacheRestoreResult.READY,
                                 host_staged=False)  # fmt: skip
    q = _queue(timeout=0.0)
    q.queue = [decode_req]
    q.enable_deferred_kv_release = True
    q.tp_rank = 0
    q.spec_algorithm = MagicMock()
    q._clean_hicache_prefetch_resources = MagicMock()
    q.scheduler = MagicMock(enable_decode_hicache=False, enable_hisparse=False)
    q.scheduler.metrics_reporter.enable_metrics = False
    polls = patch.object(decode_mod, "poll_and_all_reduce",
                         side_effect=lambda pollers, group, **_: [p.poll() for p in pollers])
    with (polls, patch.object(decode_mod, "release_kv_cache") as release,
          patch.object(decode_mod, "prepare_abort") as abort):  # fmt: skip
        assert q.pop_transferred() == []
        q.resolve_deferred_releases()
        release.assert_not_called()  # held: pdflow has not released the pages
        assert "lost connection with prefill" in abort.call_args.args[1]
        assert [entry[0] for entry in q._deferred_releases] == [decode_req]
        assert receiver.abort_notified
        mgr.book.apply(_released(7))
        q.resolve_deferred_releases()
        release.assert_called_once()
    assert q.queue == [] and decode_req.kv_receiver is None


def _released_now(q: DecodeTransferQueue) -> bool:
    with patch.object(decode_mod, "release_kv_cache") as release:
        q.resolve_deferred_releases()
        return release.call_count == 1


def test_a_room_whose_pages_never_reached_pdflow_is_released_without_waiting() -> None:
    """No writer can know pages pdflow never had: SGLang frees them at once (it waited for a
    PagesReleased that never comes, holding the pages and the metadata slot forever)."""
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    mgr = _manager()
    unpublished = _decode_req(mgr, 800, 1, publish=False)  # aborted before send_metadata
    host = PdflowKVReceiver(mgr, "10.0.0.1:8998", 801)  # send_metadata refused in the adapter
    host.init(0)
    host.send_metadata([1, 2], 2, None, destination=KVTransferDestination.HOST)
    host.abort()
    refused = _decode_req(mgr, 802, 3)  # publish_pages queued, then refused by the core
    mgr._refused(802, "publish_pages", ValueError("page 2 is quarantined"))
    published = _decode_req(mgr, 803, 4)  # pdflow has these: held until released
    receivers = (unpublished.kv_receiver, host, refused.kv_receiver, published.kv_receiver)
    for room, receiver in zip((800, 801, 802, 803), receivers, strict=True):
        q = _queue(timeout=30.0)
        q._defer_release(SimpleNamespace(req=SimpleNamespace(bootstrap_room=room),
                                         kv_receiver=receiver, metadata_buffer_index=room,
                                         host_staged=False))  # fmt: skip
        assert _released_now(q) is (room != 803), room


def test_a_room_sglang_aborts_after_pdflow_reported_success_is_released() -> None:
    """Every writer reported its writes landed, so no write can come: the abort that raced
    SGLang's next poll must not hold the pages until a clear that only the release makes."""
    mgr, q = _manager(), _queue(timeout=30.0)
    receiver = PdflowKVReceiver(mgr, "10.0.0.1:8998", 810)
    receiver.init(0)
    receiver.send_metadata([1, 2], 5, None)
    mgr.book.apply(RoomStatus(rank=0, room=810, generation=0, poll=PdflowPoll.Success))
    receiver.abort()  # Scheduler.abort_request before the scheduler saw the Success
    assert receiver.poll() == KVPoll.Failed
    q._defer_release(SimpleNamespace(req=SimpleNamespace(bootstrap_room=810),
                                     kv_receiver=receiver, metadata_buffer_index=5,
                                     host_staged=False))  # fmt: skip
    assert _released_now(q)
    assert ("clear" in {name for _, name in mgr.calls})  # and pdflow forgets the room


def test_a_prefill_abort_clears_the_room_even_if_sglang_never_polls_again() -> None:
    """release_aborted_prefill_waiting_req calls abort() and drops the request."""
    sender = _sender(820)
    book = sender.kv_mgr.book
    book.apply(RoomStatus(rank=0, room=820, generation=0, poll=PdflowPoll.WaitingForInput))
    sender.abort()
    assert [name for _, name in sender.kv_mgr.calls] == ["open_room", "abort", "clear"]
    book.apply(RoomStatus(rank=0, room=820, generation=0, poll=PdflowPoll.Failed,
                          reason="aborted by SGLang"))  # fmt: skip
    book.apply(RoomClosed(rank=0, room=820, generation=0))
    assert len(book) == 0, "an aborted room must not stay in the book"
    assert sender.poll() == KVPoll.Failed  # had SGLang polled on after all
    with pytest.raises(KVTransferError, match="aborted by SGLang"):
        sender.failure_exception()


def test_the_book_forgets_each_room_once_sglang_and_pdflow_are_both_done() -> None:
    mgr = _manager(PrefillNode)
    ok, failed = PdflowKVSender(mgr, "a:1", 830), PdflowKVSender(mgr, "a:1", 831)
    book = mgr.book
    book.record_transfer(830, 4096, 0.002)
    book.apply(RoomStatus(rank=0, room=830, generation=0, poll=PdflowPoll.Success))
    assert ok.poll() == KVPoll.Success
    ok.clear()  # SGLang's inflight queue on Success, then it reads the metric
    book.apply(RoomClosed(rank=0, room=830, generation=0))
    assert ok.get_transfer_metric().transfer_total_bytes == 4096
    book.apply(RoomStatus(rank=0, room=831, generation=0, poll=PdflowPoll.Failed,
                          reason="lost the decode"))  # fmt: skip
    assert failed.poll() == KVPoll.Bootstrapping  # draining: pdflow clears, then closes
    book.apply(RoomClosed(rank=0, room=831, generation=0))
    assert failed.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="lost the decode"):
        failed.failure_exception()
    decode = _manager()
    receiver = PdflowKVReceiver(decode, "a:1", 832)
    receiver.init(0)
    receiver.send_metadata([1, 2], 0, None)
    decode.book.apply(RoomStatus(rank=0, room=832, generation=0, poll=PdflowPoll.Success))
    assert receiver.poll() == KVPoll.Success
    receiver.clear()
    decode.book.apply(_released(832))
    decode.book.apply(RoomClosed(rank=0, room=832, generation=0))
    never_opened = PdflowKVReceiver(decode, "a:1", 833)
    never_opened.clear()
    assert (len(book), len(decode.book)) == (0, 0), "finished rooms must leave the book"


def test_a_room_failed_by_another_tp_rank_is_aborted_and_cleared_on_this_one() -> None:
    """SGLang's prefill takes the lowest poll over its TP ranks: a rank whose own room is still
    transferring is concluded as failed (failure_exception) and never polled again."""
    sender = _sender(840)
    book = sender.kv_mgr.book
    book.apply(RoomStatus(rank=0, room=840, generation=0, poll=PdflowPoll.Transferring))
    assert sender.poll() == KVPoll.Transferring  # this rank's own view
    with pytest.raises(KVTransferError):
        sender.failure_exception()  # handle_inflight_transfer_failure, after the reduction
    assert [name for _, name in sender.kv_mgr.calls] == ["open_room", "abort", "clear"]
    book.apply(RoomClosed(rank=0, room=840, generation=0))  # pdflow drained it, then forgot it
    assert len(book) == 0


def test_a_room_id_still_in_use_fails_the_newer_request_and_leaves_the_earlier_alone() -> None:
    """pdflow's events name a room by id and the adapter's fixed generation only: a second
    request with the id of one still held (its pages quarantined) would share its entry, and
    SGLang would free the earlier request's pages on the newer one's facts."""
    mgr = _manager()
    earlier = _decode_req(mgr, room=900, idx=1)  # aborted while pdflow holds its pages
    assert not earlier.kv_receiver.is_abort_release_safe()
    calls_before = list(mgr.calls)
    newer = PdflowKVReceiver(mgr, "10.0.0.1:8998", 900)
    newer.init(0)
    newer.send_metadata([3, 4], 2, None)
    assert newer.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="room id 900 is still in use"):
        newer.failure_exception()
    newer.ensure_abort_notified(force_arm=True)  # SGLang's path for a failure it did not start
    assert not newer.abort_notified, "nothing of the newer request is in pdflow to hold"
    assert newer.is_abort_release_safe()
    newer.clear()
    assert mgr.calls == calls_before, "the newer request must not touch pdflow's room 900"
    assert not earlier.kv_receiver.is_abort_release_safe(), "the earlier pages are still held"
    mgr.book.apply(_released(900))
    assert earlier.kv_receiver.is_abort_release_safe()
    earlier.kv_receiver.clear()
    mgr.book.apply(RoomClosed(rank=0, room=900, generation=0))
    assert len(mgr.book) == 0
    again = PdflowKVReceiver(mgr, "10.0.0.1:8998", 900)  # the id is free once both are done
    again.init(0)
    assert again.poll() == KVPoll.Bootstrapping and mgr.calls[-1] == (900, "open_room")


def test_a_prefill_room_id_still_in_use_fails_the_newer_sender_only() -> None:
    earlier = _sender(910)
    mgr, book = earlier.kv_mgr, earlier.kv_mgr.book
    book.apply(RoomStatus(rank=0, room=910, generation=0, poll=PdflowPoll.Transferring))
    newer = PdflowKVSender(mgr, "a:1", 910)
    newer.init(4)
    newer.send([0, 1, 2, 3])
    assert newer.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="room id 910 is still in use"):
        newer.failure_exception()
    newer.abort()
    newer.clear()
    assert [name for _, name in mgr.calls] == ["open_room"], "the earlier request's call only"
    assert earlier.poll() == KVPoll.Transferring


def test_the_book_keeps_a_finished_closed_room_until_its_pages_are_released() -> None:
    """An unknown room reads as release-safe, so a room pdflow closed before it released the
    pages (a staged room aborted while it verifies) must stay until PagesReleased."""
    book = RoomBook()
    assert book.claim(920)
    book.give_pages(920)
    book.finish(920)
    book.apply(RoomClosed(rank=0, room=920, generation=0))
    assert not book.release_safe(920) and len(book) == 1
    book.apply(_released(920))
    assert book.release_safe(920) and len(book) == 0
    book.refuse(920, "a late refusal of a queued call")  # an entry dropped is not made again
    book.give_pages(920)
    book.close(920)
    assert len(book) == 0 and book.claim(920)
