"""The decode node's admission gate: the core's AdmissionQueue driven from the event loop.

A request enters with :meth:`AdmissionGate.admit` once its room waits for pages, and waits there
(FIFO, head-of-line) until the core's rule allows it: afterwards the pages still free must cover
the largest growth any single admitted request may need, because an admitted request, waiting
for or in transfer, cannot be retracted (the sglang#30033 deadlock). An admitted request keeps
its pages counted until the engine finishes it or pdflow releases the pages of its failed room:
a quarantined room's pages stay out of the pool admission sees until they are released.

Every call runs on the node's event loop; the queue is only touched there.
"""

from __future__ import annotations

import anyio

from pdflow.core.framework.step import Step
from pdflow.core.resources.admission import (
    AdmissionBudget,
    AdmissionQueue,
    AdmitRequests,
    CancelRequest,
    EnqueueRequest,
    FinishRequest,
    RequestAdmitted,
    RequestRejected,
)


class AdmissionRefused(Exception):
    """The request can never fit this rank's pool (or left the queue before admission)."""


class AdmissionGate:
    """One decode rank's admission queue, its waiters and the requests it admitted."""

    def __init__(self, budget: AdmissionBudget) -> None:
        self.queue = AdmissionQueue(budget)
        self._waiting: dict[str, anyio.Event] = {}
        self._granted: dict[str, int] = {}
        self._refused: dict[str, str] = {}

    @property
    def queued(self) -> int:
        return len(self.queue.queue)

    @property
    def admitted(self) -> int:
        return len(self.queue.admitted)

    def is_admitted(self, request_id: str) -> bool:
        return request_id in self.queue.admitted

    def admitted_with_prefix(self, prefix: str) -> list[str]:
        """The admitted requests whose id starts with ``prefix`` (a walk over the admitted:
        for an error message, never on a hot path)."""
        return [rid for rid in self.queue.admitted if rid.startswith(prefix)]

    async def admit(self, request_id: str, input_len: int, max_new: int,
                    prefix_len: int = 0) -> int:  # fmt: skip
        """Wait until the request is admitted; return the pages it holds (publish that many).

        Raises :class:`AdmissionRefused` when it can never fit, or when it was withdrawn
        while queued; a cancelled waiter leaves the queue.
        """
        step = self._step(EnqueueRequest(request_id, input_len, max_new, prefix_len))
        for output in step.outputs:
            if isinstance(output, RequestRejected):
                raise AdmissionRefused(output.reason)
        admitted = self._waiting[request_id] = anyio.Event()
        self._admit_what_fits()
        try:
            await admitted.wait()
        except BaseException:
            self.withdraw(request_id)
            raise
        if request_id in self._refused:
            raise AdmissionRefused(self._refused.pop(request_id))
        return self._granted.pop(request_id)

    def finish(self, request_id: str) -> None:
        """The request's pages are back in the pool (engine done, or failed room released)."""
        self._granted.pop(request_id, None)
        if request_id in self.queue.admitted:
            self._step(FinishRequest(request_id))
            self._admit_what_fits()

    def withdraw(self, request_id: str) -> None:
        """A queued request leaves (its room failed or was cleared before admission)."""
        if request_id in self.queue.queue:
            self._step(CancelRequest(request_id))
            waiter = self._waiting.pop(request_id, None)
            if waiter is not None:
                self._refused[request_id] = "withdrawn from the admission queue before admission"
                waiter.set()
            self._admit_what_fits()

    def _admit_what_fits(self) -> None:
        for output in self._step(AdmitRequests()).outputs:
            if isinstance(output, RequestAdmitted):
                self._granted[output.request_id] = output.reserve_pages
                waiter = self._waiting.pop(output.request_id, None)
                if waiter is not None:
                    waiter.set()

    def _step(self, inp: EnqueueRequest | AdmitRequests | FinishRequest | CancelRequest) -> Step:
        return self.queue.handle(inp, anyio.current_time())
