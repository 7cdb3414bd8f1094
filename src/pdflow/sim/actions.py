"""Actions on a World: what can happen next, and doing it.

Every kind in :data:`pdflow.sim.faults.ACTION_KINDS` has a ``choices`` list (empty: not
enabled now) and an ``apply`` that takes an index into that list, plus a ``hint`` integer for
sizes (chunk length, request length). Both drivers use these: Hypothesis rules draw the index
and the hint; the seeded runner draws them from the seed. No enabled choice is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from pdflow.core.endpoints.endpoint_io import (
    OpenReceiver,
    OpenRoom,
    RoomCall,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import AbortRequested, InitTransfer, PrefillCompleted, SendChunk
from pdflow.core.resources.admission import QueueState
from pdflow.sim.engine import DecodeProcess, PrefillProcess
from pdflow.sim.network import host_of
from pdflow.sim.world import BOOTSTRAP, HEALTH, World

ADVANCE_STEPS = (None, 1.0, 3.0)
"""None: jump to the next deadline (or 0.5 s when none is pending)."""
MAX_IN_FLIGHT = 48


def choices(world: World, kind: str) -> list[Any]:
    return _CHOICES[kind](world)


def apply(world: World, kind: str, index: int, hint: int = 0) -> Any:
    """Apply choice ``index % len(choices)`` of ``kind``; returns the choice taken."""
    options = choices(world, kind)
    if not options:
        raise ValueError(f"action {kind!r} is not enabled now")
    choice = options[index % len(options)]
    _APPLY[kind](world, choice, hint)
    world.actions += 1
    return choice


# ---- choices -----------------------------------------------------------------------------------
def _requests(world: World) -> list[Any]:
    return [()] if len(world.active_requests()) < world.plan.max_open_requests else []


def _unopened_prefill(world: World) -> list[Any]:
    """Requests a prefill engine may open now: one whose room id it still holds open (for
    another generation) waits until the engine has cleared that one."""
    return [
        (i, rank)
        for i, r in enumerate(world.requests)
        if r.prefill_life == world.prefill_life
        for rank in sorted(r.unopened_prefill)
        if not world.prefill[rank].endpoint.is_open(r.room)
    ]


def _unopened_decode(world: World) -> list[Any]:
    return [
        (i, rank)
        for i, r in enumerate(world.requests)
        for rank in sorted(r.unopened_decode)
        if r.decode_lives[rank] == world.decode[rank].life
        and not world.decode[rank].endpoint.is_open(r.room)
    ]


def _open_rooms(world: World, side: str) -> list[Any]:
    processes = world.prefill if side == "prefill" else world.decode
    return [(p.rank, room) for p in processes for room in p.endpoint.open_rooms()]


def _terminal_rooms(world: World, side: str) -> list[Any]:
    """Rooms the engine may clear (a cleared prefill room that still drains is not the
    engine's any more: the endpoint holds it out of sight)."""
    processes: list[PrefillProcess] | list[DecodeProcess] = (
        world.prefill if side == "prefill" else world.decode
    )
    return [(p.rank, room) for p in processes for room in p.endpoint.clearable_rooms()]


def _progress(world: World) -> list[Any]:
    return [
        (p.rank, room)
        for p in world.prefill
        for room in sorted(p.jobs)
        if p.endpoint.is_open(room) and p.next_engine_call(room) is not None
    ]


def _racing(world: World) -> list[Any]:
    """Open prefill rooms whose engine may race the endpoint: it issues its next call (or a
    second PrefillCompleted) without having seen the room's last status change."""
    return [
        (p.rank, room)
        for p in world.prefill
        for room in p.endpoint.open_rooms()
        if room in p.jobs and p.jobs[room].request.generation == p.endpoint.generation_of(room)
    ]


def _moving(world: World) -> list[Any]:
    """Writes whose writer's transport can move them: a stopped prefill's cannot, nor one
    whose writer's or target's host is off the network (they wait for the heal)."""
    if world.prefill_paused:
        return []
    cut = world.network.host_cut
    return [w for w in world.transport.writes.values()
            if not cut(w.writer.address) and not cut(w.target.address)]  # fmt: skip


def _unlanded(world: World) -> list[Any]:
    return [w.wid for w in _moving(world) if not w.landed]


def _late(world: World) -> list[Any]:
    """Writes whose decode room already failed or is gone: landing now is landing late."""
    late = []
    for w in _moving(world):
        room = world.decode[w.target_rank].endpoint.summary(w.room)
        failed = room is not None and room.poll is KVPoll.Failed
        gone = room is None or room.generation != w.generation
        if not w.landed and (gone or failed):
            late.append(w.wid)
    return late


def _landed(world: World) -> list[Any]:
    return [w.wid for w in _moving(world) if w.landed]


def _deliverable(world: World) -> list[Any]:
    """A stopped prefill reads nothing: messages to it wait until it resumes."""
    stopped = {p.me.address for p in world.prefill} if world.prefill_paused else set()
    return [where for where in world.network.deliverable() if where[0][1] not in stopped]


def _superseded_registrations(world: World) -> list[Any]:
    """Registrations of earlier prefill lives: a dead process may retry one late."""
    return [i for i, r in enumerate(world.registrations)
            if r.incarnation != world.prefill_incarnation]  # fmt: skip


def race_windows(world: World) -> list[Any]:
    """Windows a uniform pick of the next action seldom lands in, and the race timed into
    each: the prefill engine aborts a room between chunks (in a world whose engines abort) or
    one that drains, or makes its next call on a draining room it has not polled yet; a late
    copy of a message the room already got arrives while it transfers or drains (prefill) or
    while the node verifies it (decode)."""
    windows: list[Any] = []
    racing = set(_racing(world))
    for p in [] if world.prefill_paused else world.prefill:
        for room in p.endpoint.open_rooms():
            summary = p.endpoint.summary(room)
            assert summary is not None
            job = p.jobs.get(room)
            draining = summary.state == "DRAINING"
            transferring = summary.state == "TRANSFERRING"
            chunks_left = job is not None and not job.last_sent
            between_chunks = transferring and (chunks_left or not summary.outstanding)
            if world.plan.weights["abort_prefill"] > 0 and (draining or between_chunks):
                windows.append(("abort", p.rank, room))
            if draining and (p.rank, room) in racing:
                windows.append(("engine_race", p.rank, room, "completion"))
                if job is not None and job.computed and job.initialized and chunks_left:
                    windows.append(("engine_race", p.rank, room, "chunk"))
            if draining or transferring:
                windows += _late_copies(world, p, room, summary.generation)
    for d in world.decode:
        for room in _verifying(d):
            verifying = d.endpoint.summary(room)
            assert verifying is not None
            windows += _late_copies(world, d, room, verifying.generation)
    return windows


def _verifying(decode: DecodeProcess) -> list[int]:
    """The decode rank's rooms whose checksums its node verifies now (its engine sees them
    Transferring)."""
    return [
        room
        for room in decode.endpoint.open_rooms()
        if getattr(decode.endpoint.summary(room), "state", None) == "VERIFYING"
    ]


def _late_copies(
    world: World, process: PrefillProcess | DecodeProcess, room: int, generation: int
) -> list[Any]:
    got = world.last_delivered.get((process.name, room, generation), {})
    return [("late_copy", process.name, room, generation, kind) for kind in sorted(got)
            if world.network.passes(got[kind])]  # fmt: skip


def _mid_write(world: World) -> bool:
    """A prefill room has chunks still to send, or a decode room verifies what its writers
    reported written."""
    return _mid_transfer(world) or any(_verifying(d) for d in world.decode)


def _writes_in_flight(world: World) -> bool:
    """A write the live prefill life started has not landed yet."""
    live = {p.me for p in world.prefill}
    return any(not w.landed and w.writer in live for w in world.transport.writes.values())


def _mid_transfer(world: World) -> bool:
    """Some prefill room is transferring with chunks still to send."""
    return any(
        getattr(p.endpoint.summary(room), "state", None) == "TRANSFERRING"
        and not p.jobs[room].last_sent
        for p in world.prefill
        for room in p.endpoint.open_rooms()
        if room in p.jobs
    )


def _partitions(world: World) -> list[Any]:
    """Links a partition may cut: a prefill rank's control link to a decode rank, or the link
    from a decode rank to the prefill's health endpoint (its heartbeat probes)."""
    prefill_side = [p.me.address for p in world.prefill] + [HEALTH]
    return [
        (address, d.me.address)
        for address in prefill_side
        for d in world.decode
        if not world.network.is_cut((address, d.me.address))
    ]


def _hosts(world: World) -> list[Any]:
    """Hosts that may drop off the network: the prefill instance's (its ranks and its health
    endpoint) or the decode instance's, while still connected."""
    addresses = [p.me.address for p in world.processes()] + [HEALTH]
    return sorted({host_of(a) for a in addresses} - world.network.cut_hosts)


_CHOICES: dict[str, Callable[[World], list[Any]]] = {
    "new_request": _requests,
    "open_prefill": _unopened_prefill,
    "open_decode": _unopened_decode,
    "duplicate_claim": lambda w: (
        [("prefill", *c) for c in _open_rooms(w, "prefill")]
        + [("decode", *c) for c in _open_rooms(w, "decode")]
    ),
    "prefill_progress": lambda w: [] if w.prefill_paused else _progress(w),
    "decode_allocate": lambda w: [
        d.rank for d in w.decode if d.admission.state is QueueState.QUEUED
    ],
    "local_event": lambda w: list(range(len(w.local_events))),
    "deliver": _deliverable,
    "drop": lambda w: w.network.in_flight(),
    "duplicate": lambda w: w.network.in_flight() if len(w.network) < MAX_IN_FLIGHT else [],
    "write_complete": _unlanded,
    "write_fail": _unlanded,
    "write_land": _unlanded,
    "write_land_late": _late,
    "write_report": _landed,
    "write_corrupt": lambda w: _unlanded(w) if w.shape.verify_checksums else [],
    "advance": lambda w: list(range(len(ADVANCE_STEPS))),
    "abort_prefill": lambda w: [] if w.prefill_paused else _open_rooms(w, "prefill"),
    "abort_decode": lambda w: _open_rooms(w, "decode"),
    "clear_prefill": lambda w: [] if w.prefill_paused else _terminal_rooms(w, "prefill"),
    "clear_decode": lambda w: _terminal_rooms(w, "decode"),
    "crash_prefill": lambda w: [()],
    "crash_decode": lambda w: list(range(len(w.decode))),
    "heartbeat_ok": lambda w: list(range(len(w.decode))),
    "heartbeat_fail": lambda w: list(range(len(w.decode))),
    "pause_prefill": lambda w: [] if w.prefill_paused else [()],
    "resume_prefill": lambda w: [()] if w.prefill_paused else [],
    "late_registration": _superseded_registrations,
    "partition": _partitions,
    "partition_host": _hosts,
    "heal": lambda w: [()] if w.network.partitioned else [],
    "engine_race": lambda w: [] if w.prefill_paused else _racing(w),
    "redeliver": lambda w: list(range(len(w.network.recent))) if len(w.network) < MAX_IN_FLIGHT
    else [],
    "window_race": race_windows,
    "abort_verifying": lambda w: [(d.rank, room) for d in w.decode for room in _verifying(d)],
    "stall_mid_write": lambda w: [()] if not w.prefill_paused and _mid_write(w) else [],
    "crash_mid_write": lambda w: [()] if _writes_in_flight(w) else [],
}


# ---- applying ----------------------------------------------------------------------------------
def _new_request(world: World, choice: Any, hint: int) -> None:
    world.new_request(hint)


def _open_prefill(world: World, choice: tuple[int, int], hint: int) -> None:
    world.open_prefill(world.requests[choice[0]], choice[1])


def _open_decode(world: World, choice: tuple[int, int], hint: int) -> None:
    world.open_decode(world.requests[choice[0]], choice[1])


def _duplicate_claim(world: World, choice: tuple[str, int, int], hint: int) -> None:
    side, rank, room = choice
    if side == "prefill":
        process = world.prefill[rank]
        generation = _open_generation(process, room) + 1
        world.expect_refusal(process, OpenRoom(room, generation))
    else:
        decode = world.decode[rank]
        generation = _open_generation(decode, room) + 1
        world.expect_refusal(decode, OpenReceiver(room, generation, BOOTSTRAP))


def _open_generation(process: PrefillProcess | DecodeProcess, room: int) -> int:
    generation = process.endpoint.generation_of(room)
    if generation is None:
        raise KeyError(f"{process.name}: room {room} is not open")
    return generation


def _prefill_progress(world: World, choice: tuple[int, int], hint: int) -> None:
    process: PrefillProcess = world.prefill[choice[0]]
    room = choice[1]
    job = process.jobs[room]
    call = process.next_engine_call(room)
    if call == "complete":
        world.mark_complete(process, room)
    elif call == "init":
        job.initialized = True
        world.feed(process, RoomCall(room, InitTransfer(job.request.num_pages, aux_index=room % 8)))
    else:
        remaining = job.request.num_pages - job.next_page
        size = 1 + hint % remaining
        pages = job.src_pages[job.next_page : job.next_page + size]
        job.next_page += size
        world.feed(process, RoomCall(room, SendChunk(pages, is_last=size == remaining)))


def _engine_race(world: World, choice: tuple[int, int], hint: int) -> None:
    """The engine's next call, issued whatever the room polls now (a failure it has not seen
    yet, a notice sent twice). The endpoint takes it or refuses it and changes nothing."""
    process: PrefillProcess = world.prefill[choice[0]]
    room = choice[1]
    job = process.jobs[room]
    call: PrefillCompleted | InitTransfer | SendChunk
    size = 0
    if not job.computed or job.last_sent or hint % 3 == 0:
        call = PrefillCompleted()
    elif not job.initialized:
        call = InitTransfer(job.request.num_pages, aux_index=room % 8)
    else:
        remaining = job.request.num_pages - job.next_page
        size = 1 + hint % remaining
        pages = job.src_pages[job.next_page : job.next_page + size]
        call = SendChunk(pages, is_last=size == remaining)
    if not world.take_or_refuse(process, RoomCall(room, call)):
        return
    if isinstance(call, PrefillCompleted):
        job.computed = True
    elif isinstance(call, InitTransfer):
        job.initialized = True
    else:
        job.next_page += size


def _write_complete(world: World, wid: int, hint: int) -> None:
    write = world.transport.writes[wid]
    ok = world.transport.land(write)
    _report(world, wid, ok, "" if ok else "target unreachable")


def _write_fail(world: World, wid: int, hint: int) -> None:
    write = world.transport.writes[wid]
    partial = hint % (len(write.dst_pages) + 1)
    if partial:
        world.transport.land(write, pages=partial)  # a failed write may have landed in part
    _report(world, wid, False, "injected transport failure")


def _write_land(world: World, wid: int, hint: int) -> None:
    write = world.transport.writes[wid]
    if not world.transport.land(write):
        _report(world, wid, False, "target unreachable")


def _write_report(world: World, wid: int, hint: int) -> None:
    _report(world, wid, True, "")


def _write_corrupt(world: World, wid: int, hint: int) -> None:
    write = world.transport.writes[wid]
    ok = world.transport.land(write, corrupt=True)
    _report(world, wid, ok, "" if ok else "target unreachable")


def _report(world: World, wid: int, ok: bool, reason: str) -> None:
    """The writer's transport reports the write (if the writer process is still alive)."""
    from pdflow.core.protocol.inputs import TransferCompleted

    write = world.transport.writes[wid]
    world.transport.finish(write)
    process = world.writer_process(write)
    if process is None:
        return
    checksum = write.checksum if ok and world.shape.prefill_checksums else None
    aux = write.aux if ok else None
    done = TransferCompleted(write.room, write.generation, write.seq, ok, reason, checksum, aux)
    world.feed(process, done)


def _advance(world: World, index: int, hint: int) -> None:
    step = ADVANCE_STEPS[index]
    if step is None:
        deadline = world.next_deadline()
        if deadline is not None and deadline > world.clock.now:
            world.clock.advance_to(deadline)
        else:
            world.clock.advance(0.5)
    else:
        world.clock.advance(step)
    world.fire_timers()


def _abort(side: str) -> Callable[[World, tuple[int, int], int], None]:
    def run(world: World, choice: tuple[int, int], hint: int) -> None:
        process = (world.prefill if side == "prefill" else world.decode)[choice[0]]
        world.feed(process, RoomCall(choice[1], AbortRequested(f"{side} engine aborted")))

    return run


def _clear(side: str) -> Callable[[World, tuple[int, int], int], None]:
    def run(world: World, choice: tuple[int, int], hint: int) -> None:
        process = (world.prefill if side == "prefill" else world.decode)[choice[0]]
        room = choice[1]
        generation = process.endpoint.generation_of(room)
        world.clear(process, room)
        late = world.last_delivered.pop((process.name, room, generation), {})  # type: ignore[arg-type]
        draining = generation is not None and isinstance(process, PrefillProcess) and (
            process.endpoint.is_draining(room, generation)
        )
        if draining and world.plan.weights["redeliver"] > 0:
            # A late copy of the room's metadata, or of an ABORT, reaches it while it drains
            # out of sight.
            for kind in sorted(late):
                if kind.startswith(("RoomMetadata", "Abort")) and world.network.passes(late[kind]):
                    world.deliver(late[kind])

    return run


def _heartbeat(ok: bool) -> Callable[[World, int, int], None]:
    """One heartbeat round of one decode rank: a probe of each target it names, which fails
    when the link to the target's health endpoint (else to its registry) is cut; ``ok=False``
    fails them though the prefill may be up (a false failure: a stalled registry, a lost
    probe)."""

    def run(world: World, rank: int, hint: int) -> None:
        decode = world.decode[rank]
        for target in decode.endpoint.probe_targets():
            seen = world.probe(target)
            cut = world.network.is_cut((target.health or target.bootstrap, decode.me.address))
            if not ok or cut:
                seen = msgspec.structs.replace(seen, ok=False, incarnation=None)
            world.feed(decode, seen)

    return run


def _late_registration(world: World, index: int, hint: int) -> None:
    """A dead prefill life's registration arrives late: the registry must refuse it (409)
    and change nothing."""
    registration = world.registrations[index]
    before = world.registry.snapshot()
    reply = world.ask_registry(registration)
    world.monitor.checking("registry_ordered")
    if reply.status != 409 or world.registry.snapshot() != before:
        world.monitor.fail(
            "registry_ordered",
            f"the registry answered {reply.status} to a late registration of superseded "
            f"incarnation {registration.incarnation} (live: {world.prefill_incarnation})"
        )


def _window_race(world: World, window: tuple[Any, ...], hint: int) -> None:
    what = window[0]
    if what == "abort":
        _abort("prefill")(world, window[1:], hint)
    elif what == "engine_race":
        _, rank, room, call = window
        # _engine_race repeats the completion notice when the hint is a multiple of 3.
        _engine_race(world, (rank, room), 3 * hint + (call == "chunk"))
    else:
        _, name, room, generation, kind = window
        world.deliver(world.last_delivered[(name, room, generation)][kind])


def _stall(world: World) -> None:
    """The prefill stops (SIGSTOP) for as long as it takes every decode rank to declare it dead
    (heartbeat rounds) and its shell to fence it; then it resumes and answers the next probe.
    What it still had to send, and the ABORTs on their way to it, race on from there."""
    world.pause_prefill()
    for _ in range(max(d.config.heartbeat_max_failure for d in world.decode)):
        for rank in range(len(world.decode)):
            _heartbeat(True)(world, rank, 0)
    while fences := [i for i, e in enumerate(world.local_events) if e.kind == "fence"]:
        world.run_local_event(fences[0])
    world.resume_prefill()
    for rank in range(len(world.decode)):
        _heartbeat(True)(world, rank, 0)


def _partition(world: World, choice: tuple[str, str], hint: int) -> None:
    world.network.partition(*choice)


_APPLY: dict[str, Callable[[World, Any, int], object]] = {
    "new_request": _new_request,
    "open_prefill": _open_prefill,
    "open_decode": _open_decode,
    "duplicate_claim": _duplicate_claim,
    "prefill_progress": _prefill_progress,
    "decode_allocate": lambda w, rank, hint: w.admit(w.decode[rank]),
    "local_event": lambda w, index, hint: w.run_local_event(index),
    "deliver": lambda w, where, hint: w.deliver(w.network.take(where)),
    "drop": lambda w, where, hint: w.network.drop(where),
    "duplicate": lambda w, where, hint: w.network.duplicate(where),
    "write_complete": _write_complete,
    "write_fail": _write_fail,
    "write_land": _write_land,
    "write_land_late": _write_land,
    "write_report": _write_report,
    "write_corrupt": _write_corrupt,
    "advance": _advance,
    "abort_prefill": _abort("prefill"),
    "abort_decode": _abort("decode"),
    "clear_prefill": _clear("prefill"),
    "clear_decode": _clear("decode"),
    "crash_prefill": lambda w, choice, hint: w.crash_prefill(),
    "crash_decode": lambda w, rank, hint: w.crash_decode(rank),
    "heartbeat_ok": _heartbeat(True),
    "heartbeat_fail": _heartbeat(False),
    "pause_prefill": lambda w, choice, hint: w.pause_prefill(),
    "resume_prefill": lambda w, choice, hint: w.resume_prefill(),
    "late_registration": _late_registration,
    "partition": _partition,
    "partition_host": lambda w, host, hint: w.network.partition_host(host),
    "heal": lambda w, choice, hint: w.network.heal(),
    "engine_race": _engine_race,
    "redeliver": lambda w, index, hint: w.network.redeliver(index),
    "window_race": _window_race,
    "abort_verifying": _abort("decode"),
    "stall_mid_write": lambda w, choice, hint: _stall(w),
    "crash_mid_write": lambda w, choice, hint: w.crash_prefill(),
}


# ---- settling (the liveness phase) ---------------------------------------------------------------
class WorldDidNotSettle(RuntimeError):
    """Work went on round after round without the world coming to rest: a liveness finding
    (rooms_settle), not a simulator bug."""


def settle(world: World, max_rounds: int = 400) -> None:
    """Heal the network, let every process finish its work and time run past every deadline.

    Engines behave as a patient operator's would: they open what was requested, compute and
    send every chunk, admit what fits, clear terminal rooms, probe the prefill's health. A room
    still waiting for memory when nothing else can happen is aborted by its engine.
    """
    world.network.heal()
    world.resume_prefill()
    _last_races(world)
    for _ in range(max_rounds):
        if _work_once(world):
            continue
        for rank in range(len(world.decode)):
            apply(world, "heartbeat_ok", rank)
        if _work_once(world):
            continue
        deadline = world.next_deadline()
        if deadline is not None:
            world.clock.advance_to(max(deadline, world.clock.now + 1e-3))
            world.fire_timers()
            continue
        if not _give_up_waiting_for_memory(world):
            return
    raise WorldDidNotSettle(f"the world did not settle within {max_rounds} rounds")


def _last_races(world: World) -> None:
    """A healed network still delivers what is in flight twice."""
    for link, position in reversed(world.network.in_flight()):
        world.network.duplicate((link, position))


def _late_calls(world: World) -> bool:
    """Engines that have not polled a finished room yet: before clearing it, a prefill engine
    makes the call it had queued and repeats its completion notice, a late copy of the last
    message of each kind the room got arrives, and every engine aborts it (once per room
    instance)."""
    did = False
    for side in ("prefill", "decode"):
        processes: list[PrefillProcess] | list[DecodeProcess] = (
            world.prefill if side == "prefill" else world.decode
        )
        for process in processes:
            for room in process.endpoint.clearable_rooms():
                generation = process.endpoint.generation_of(room)
                key = (process.name, room, generation)
                if key in world.late_called or generation is None:
                    continue
                world.late_called.add(key)
                did = True
                late = world.last_delivered.get((process.name, room, generation), {})
                for kind in sorted(late) if world.plan.weights["redeliver"] > 0 else ():
                    world.deliver(late[kind])
                if isinstance(process, PrefillProcess) and room in process.jobs:
                    for hint in (0, 1 << 20):
                        _engine_race(world, (process.rank, room), hint)
                _abort(side)(world, (process.rank, room), 0)
    return did


def _work_once(world: World) -> bool:
    did = _late_calls(world)
    for kind in (
        "local_event",
        "deliver",
        "write_complete",
        "write_report",
        "open_prefill",
        "open_decode",
        "prefill_progress",
        "decode_allocate",
        "clear_prefill",
        "clear_decode",
    ):
        if kind.startswith("clear_"):
            did = _late_calls(world) or did
        while choices(world, kind):
            apply(world, kind, 0, hint=1 << 20)
            did = True
    return did


def _give_up_waiting_for_memory(world: World) -> bool:
    gave_up = False
    for decode in world.decode:
        for room, job in sorted(decode.jobs.items()):
            if job.stage == "queued" and decode.endpoint.is_open(room):
                world.feed(decode, RoomCall(room, AbortRequested("no memory for this request")))
                gave_up = True
    return gave_up
