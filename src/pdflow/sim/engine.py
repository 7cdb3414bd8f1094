"""Fake inference engines: they drive endpoints the way a serving engine would.

A :class:`PrefillProcess` is one prefill rank's process life: its endpoint and its engine's view
of each room (source pages, chunks sent). A :class:`DecodeProcess` is one decode rank's life:
endpoint, admission queue and each room's request. A crash replaces the process object:
nothing of the old life survives.
The engines only read what an engine may see (polls, outputs, the ledger's free pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.endpoint_io import DecodeEndpointConfig, PrefillEndpointConfig
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import PeerId
from pdflow.core.resources.admission import AdmissionBudget, AdmissionQueue


@dataclass
class Request:
    """One client request: a room instance served by a prefill DP group and a decode DP group."""

    room: int
    generation: int
    input_len: int
    max_new: int
    num_pages: int
    prefill_ranks: tuple[int, ...]
    decode_ranks: tuple[int, ...]
    prefill_life: int
    decode_lives: dict[int, int]
    unopened_prefill: set[int] = field(default_factory=set)
    unopened_decode: set[int] = field(default_factory=set)

    @property
    def rid(self) -> str:
        return f"{self.room}/{self.generation}"


@dataclass
class SenderJob:
    request: Request
    src_pages: tuple[int, ...]
    next_page: int = 0
    initialized: bool = False
    computed: bool = False
    poll: KVPoll = KVPoll.Bootstrapping

    @property
    def last_sent(self) -> bool:
        return self.initialized and self.next_page >= self.request.num_pages


@dataclass
class PrefillProcess:
    rank: int
    life: int
    name: str
    config: PrefillEndpointConfig
    endpoint: PrefillEndpoint
    free_sources: list[int]
    jobs: dict[int, SenderJob] = field(default_factory=dict)
    draining_jobs: dict[tuple[int, int], SenderJob] = field(default_factory=dict)
    """Rooms the engine cleared while their writes drain: their source pages stay pinned."""

    @property
    def me(self) -> PeerId:
        return self.config.me

    def next_engine_call(self, room: int) -> str | None:
        """What the engine would do next for this room, or None when it has nothing to do."""
        job = self.jobs[room]
        if not job.computed:
            return "complete"
        if job.poll not in (KVPoll.WaitingForInput, KVPoll.Transferring) or job.last_sent:
            return None
        return "chunk" if job.initialized else "init"


@dataclass
class ReceiverJob:
    request: Request
    stage: str = "resolving"
    """resolving -> queued -> admitted (pages published) -> finished; or cancelled."""
    poll: KVPoll = KVPoll.Bootstrapping
    pages: tuple[int, ...] = ()
    aux: bytes | None = None
    """What the shell stored in the request's aux slot."""


@dataclass
class DecodeProcess:
    rank: int
    life: int
    name: str
    config: DecodeEndpointConfig
    endpoint: DecodeEndpoint
    admission: AdmissionQueue
    jobs: dict[int, ReceiverJob] = field(default_factory=dict)
    requests: dict[str, ReceiverJob] = field(default_factory=dict)

    @property
    def me(self) -> PeerId:
        return self.config.me


def admission_budget(pool_pages: int, page_tokens: int) -> AdmissionBudget:
    # A small reservation keeps decode growth in the picture without starving tiny pools.
    return AdmissionBudget(
        pool_pages=pool_pages, page_size=page_tokens, reserve_tokens=page_tokens, clip_max_new=8
    )
