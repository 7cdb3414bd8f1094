"""PageLedger against a reference model under random reserve / release / fence / ACK / death."""

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdflow.core.framework.errors import InvalidInput, LocalProtocolError
from pdflow.core.protocol.messages import PeerId
from pdflow.core.resources.page_ledger import (
    AckArrived,
    Fence,
    PageLedger,
    PagesFreed,
    ReleaseAfterSuccess,
    ReleaseUnpublished,
    Reserve,
    RoomPagesState,
    SessionClosed,
    WriterDead,
)

POOL = 6
WRITERS = [PeerId(f"10.0.0.{i}:7000", "x") for i in range(3)]
ROOMS = st.integers(0, 2)
writers = st.sampled_from(WRITERS)


class Held:
    """The model of one room instance."""

    def __init__(self, pages: tuple[int, ...]) -> None:
        self.pages = pages
        self.writers: tuple[PeerId, ...] | None = None  # None until fenced
        self.acked: set[PeerId] = set()


class LedgerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = PageLedger(POOL)
        self.held: dict[tuple[int, int], Held] = {}
        self.next_generation = {room: 0 for room in range(3)}
        self.dead: set[PeerId] = set()
        self.closed: set[PeerId] = set()
        self.now = 0.0

    # ---- model helpers -------------------------------------------------------------------------
    def _taken(self) -> set[int]:
        return {p for h in self.held.values() for p in h.pages}

    def _pending(self, h: Held) -> set[PeerId]:
        assert h.writers is not None
        return {
            w for w in h.writers if w not in h.acked and not (w in self.dead and w in self.closed)
        }

    def _settle(self, freed: list[PagesFreed]) -> None:
        """Drop model rooms whose writers are all cleared; they must be exactly the ones freed."""
        expected = {
            key for key, h in self.held.items() if h.writers is not None and not self._pending(h)
        }
        assert {(f.room, f.generation) for f in freed} == expected
        for f in freed:
            assert self.held.pop((f.room, f.generation)).pages == f.pages

    def _step(self, inp: object) -> list[PagesFreed]:
        self.now += 1.0
        step = self.ledger.handle(inp, self.now)  # type: ignore[arg-type]
        return [o for o in step.outputs if isinstance(o, PagesFreed)]

    # ---- rules ---------------------------------------------------------------------------------
    @rule(room=ROOMS, data=st.data())
    def reserve(self, room: int, data: st.DataObject) -> None:
        pages = tuple(data.draw(st.lists(st.integers(0, POOL - 1), max_size=3, unique=True)))
        self.next_generation[room] += 1
        generation = self.next_generation[room]
        if set(pages) & self._taken():
            before = self.ledger.snapshot()
            with pytest.raises(InvalidInput):
                self._step(Reserve(room, generation, pages))
            assert self.ledger.snapshot() == before
            return
        assert self._step(Reserve(room, generation, pages)) == []
        self.held[(room, generation)] = Held(pages)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), success=st.booleans())
    def release(self, data: st.DataObject, success: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.held)))
        inp = ReleaseAfterSuccess(*key) if success else ReleaseUnpublished(*key)
        if self.held[key].writers is not None:
            with pytest.raises(LocalProtocolError):
                self._step(inp)
            return
        assert self._step(inp) == [PagesFreed(key[0], key[1], self.held.pop(key).pages)]

    @precondition(lambda self: any(h.writers is None for h in self.held.values()))
    @rule(data=st.data(), chosen=st.lists(writers, max_size=3, unique=True))
    def fence(self, data: st.DataObject, chosen: list[PeerId]) -> None:
        key = data.draw(
            st.sampled_from(sorted(k for k, h in self.held.items() if h.writers is None))
        )
        self.held[key].writers = tuple(chosen)
        self._settle(self._step(Fence(key[0], key[1], tuple(chosen))))

    @rule(room=ROOMS, generation=st.integers(0, 4), writer=writers)
    def ack(self, room: int, generation: int, writer: PeerId) -> None:
        h = self.held.get((room, generation))
        if h is not None and h.writers is not None and writer in h.writers:
            h.acked.add(writer)
        self._settle(self._step(AckArrived(room, generation, writer)))

    @rule(writer=writers)
    def writer_dead(self, writer: PeerId) -> None:
        self.dead.add(writer)
        self._settle(self._step(WriterDead(writer)))

    @rule(writer=writers)
    def session_closed(self, writer: PeerId) -> None:
        self.closed.add(writer)
        self._settle(self._step(SessionClosed(writer)))

    # ---- invariants ----------------------------------------------------------------------------
    @invariant()
    def counts_sum_to_the_pool(self) -> None:
        snap = self.ledger.snapshot()
        assert snap.free + snap.reserved + snap.quarantined == POOL
        assert self.ledger.allocatable == snap.free

    @invariant()
    def agrees_with_the_model(self) -> None:
        snap = self.ledger.snapshot()
        assert {(r.room, r.generation): r.pages for r in snap.rooms} == {
            key: h.pages for key, h in self.held.items()
        }
        for key, h in self.held.items():
            expected = RoomPagesState.RESERVED if h.writers is None else RoomPagesState.FENCED
            assert self.ledger.state_of(*key) is expected
            if h.writers is not None:
                assert self._pending(h), "a fenced room is held only while a writer is pending"
        quarantined = sum(len(h.pages) for h in self.held.values() if h.writers is not None)
        assert snap.quarantined == quarantined

    @invariant()
    def no_page_owned_twice(self) -> None:
        pages = [p for r in self.ledger.snapshot().rooms for p in r.pages]
        assert len(pages) == len(set(pages))
        assert all(not self.ledger.is_free(p) for p in pages)


LedgerModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("PDFLOW_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
)
TestLedgerModel = LedgerModel.TestCase
