"""FaultPlan: everything a seed decides about one simulated world, drawn swarm-style.

One ``random.Random(seed)`` draws the world's shape (both sides' parallelism, attention kind,
allocation policy, pool sizes, timeouts) and how often the seeded driver picks each kind of
action, faults included. The plan is plain data: it is the first thing a trace records, so a
failure is reproduced by its seed alone.
"""

from __future__ import annotations

import random

import msgspec

from pdflow.core.protocol.policy import AllocationPolicy

MAX_RANKS_PER_SIDE = 4
MHA_KV_HEADS = 4
"""Divisible by every TP size drawn (1, 2, 4), so both sides split heads evenly."""


class WorldShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefill_tp: int
    prefill_cp: int
    prefill_pp: int
    prefill_dp: int
    decode_tp: int
    decode_pp: int
    decode_dp: int
    is_mla: bool
    policy: AllocationPolicy
    verify_checksums: bool
    page_tokens: int
    decode_pages: int
    source_pages: int
    bootstrap_timeout: float
    waiting_timeout: float
    prefill_checksums: bool = True
    """The prefill sends a KV checksum with each Success (its PDFLOW_CHECKSUM). Always, when the
    decode requires them, except in a deliberate :attr:`checksum_mismatch` world."""
    prefill_declares_checksums: bool = True
    """Its registration says whether it does (False: it does not say, as SGLang's)."""
    receiver_fence: bool = True
    """Whether the decode's transport can fence a writer on its receiving side (in-process, a
    future RDMA binding) or not (Mooncake TCP): then a dead writer's pages wait for its ACK."""
    max_pending_room_ids: int = 65_536
    max_parked_peers: int = 64
    max_finished_room_ids: int = 65_536
    max_ownerless_ready_rooms: int = 65_536
    announces_layout: bool = False
    """The decode announces its KV layout (KvArgs) before its first message to each prefill
    rank and the prefill accepts it (the layout exchange of spec/machines/kv_layouts.toml); the
    fake transport itself moves pages by index."""
    """The prefill's slot bounds and ready-table cap (PrefillEndpointConfig); some worlds draw
    them tiny, so early metadata, ABORTs and prefill_complete bootstraps run into them as they
    would under a flood of room ids or peers, and the opened marks of finished room ids are
    forgotten while their late messages still arrive (no expiry may reopen a use-after-free)."""

    @property
    def prefill_ranks(self) -> int:
        return self.prefill_tp * self.prefill_cp * self.prefill_pp * self.prefill_dp

    @property
    def decode_ranks(self) -> int:
        return self.decode_tp * self.decode_pp * self.decode_dp

    @property
    def checksum_mismatch(self) -> bool:
        """The decode requires checksums the prefill never sends: a misconfiguration no room
        survives, drawn on purpose in a few worlds (:data:`CHECKSUM_MISMATCH_SHARE`); each of
        their rooms that gets that far must fail saying so."""
        return self.verify_checksums and not self.prefill_checksums

    @property
    def num_kv_heads(self) -> int:
        return 1 if self.is_mla else MHA_KV_HEADS


ACTION_KINDS = (
    "new_request",
    "open_prefill",
    "open_decode",
    "duplicate_claim",
    "prefill_progress",
    "decode_allocate",
    "local_event",
    "deliver",
    "drop",
    "duplicate",
    "write_complete",
    "write_fail",
    "write_land",
    "write_land_late",
    "write_report",
    "write_corrupt",
    "advance",
    "abort_prefill",
    "abort_decode",
    "clear_prefill",
    "clear_decode",
    "crash_prefill",
    "crash_decode",
    "heartbeat_ok",
    "heartbeat_fail",
    "partition",
    "heal",
    "engine_race",
    "redeliver",
    "pause_prefill",
    "resume_prefill",
    "late_registration",
    "window_race",
    "abort_verifying",
    "stall_mid_write",
    "crash_mid_write",
    "partition_host",
)

FAULT_KINDS = frozenset(
    {
        "drop",
        "duplicate",
        "write_fail",
        "write_corrupt",
        "abort_prefill",
        "abort_decode",
        "crash_prefill",
        "crash_decode",
        "heartbeat_fail",
        "partition",
        "duplicate_claim",
        "redeliver",
        "pause_prefill",
        "late_registration",
        "window_race",
        "abort_verifying",
        "stall_mid_write",
        "crash_mid_write",
        "partition_host",
    }
)


LATE_KINDS = ("engine_race",)
"""Faults added after the others: their weights are drawn last, so every earlier draw of a seed
keeps its value."""
LAST_KINDS = ("redeliver",)
"""Added after the fault profiles: drawn after them (and zeroed outside their profile)."""
NEWEST_KINDS = ("pause_prefill", "resume_prefill", "late_registration")
"""A paused, live prefill and a dead life's late registration: drawn after everything else
(the faults zeroed outside their profile), so every earlier draw of a seed keeps its value."""
WINDOW_KINDS = ("window_race", "abort_verifying", "stall_mid_write", "crash_mid_write")
"""Faults timed into a narrow window that a uniform pick of the next action seldom lands in
(see :mod:`pdflow.sim.actions`): the prefill engine's abort or next call, or a late copy of a
message, while a room is between chunks, drains or verifies (``window_race``); the decode
engine's abort while the node verifies a room's checksums (``abort_verifying``); the prefill
stopped until declared dead and fenced, then answering again, while a room has chunks left to
send or verifies (``stall_mid_write``); the prefill crashing (and coming back as a new life)
while writes it started have not landed (``crash_mid_write``: before it, 35 seeds in 2,000 had
a crash with writes in flight, and a decode that took a restart for a fence escaped 1,644
seeds). Enabled only while their window is open; drawn after everything else, so every
earlier draw of a seed keeps its value."""
HOST_KINDS = ("partition_host",)
"""A whole host dropping off the network (every link of one instance cut at once, the data
plane's writes held and the bootstrap server unreachable from it): drawn after everything
else, in the profiles that draw partitions, so every earlier draw of a seed keeps its value."""

FAULT_PROFILES: dict[str, frozenset[str]] = {
    # Every fault but the newest (a pause, a late registration): they run in the liveness
    # profile only, so they do not dilute the faults the "all" seeds were tuned to reach. A
    # stall timed mid-write runs here too: these are the seeds whose transfers get going.
    "all": FAULT_KINDS - {"pause_prefill", "late_registration"},
    # An abort while a room verifies would pre-empt the checksum failures this profile is for.
    "data_path": frozenset({"drop", "duplicate", "write_fail", "write_corrupt", "window_race"}),
    "liveness": frozenset(
        {"crash_prefill", "crash_decode", "heartbeat_fail", "partition", "partition_host",
         "pause_prefill", "late_registration", "stall_mid_write", "crash_mid_write"}
    ),
    "room_races": frozenset(
        {"drop", "duplicate", "abort_prefill", "abort_decode", "duplicate_claim", "redeliver",
         "window_race", "abort_verifying"}
    ),
}  # fmt: skip
"""Swarm testing by feature omission: a seed runs under one profile, which switches off every
fault outside it. A fault that only shows once a room survives to its end (a corrupt write
reaching verification) is reached far more often without the faults that kill rooms, and each
fault added later dilutes only the profiles it joins."""
LIVENESS_FAULTS = FAULT_PROFILES["liveness"]
CHECKSUM_MISMATCH_SHARE = 0.06
"""Of the worlds whose decode requires checksums (half of them), those whose prefill sends none
(about 3% of all worlds): enough to keep the refusal checked, few enough that the success path
is alive in the rest."""
PROFILE_WEIGHTS = {"all": 0.4, "data_path": 0.2, "liveness": 0.2, "room_races": 0.2}


class FaultPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seed: int
    shape: WorldShape
    weights: dict[str, float]
    """Relative weight of each action kind for the seeded driver (0: never picked)."""
    reorder_within_link: bool
    """Deliver any pending message of a link, not only its oldest (a link that reorders)."""
    max_open_requests: int
    room_reuse: bool
    """New requests may reuse a room id at any moment, as the next generation: while an earlier
    one still drains, is open, or was never opened somewhere (``World.new_request``)."""
    profile: str = "all"
    """The fault profile (:data:`FAULT_PROFILES`): faults outside it have weight 0."""

    def to_builtins(self) -> dict[str, object]:
        built: dict[str, object] = msgspec.to_builtins(self)
        return built


def draw_shape(rng: random.Random) -> WorldShape:
    while True:
        prefill = [
            rng.choice((1, 2, 2, 4)),
            rng.choice((1, 1, 2)),
            rng.choice((1, 1, 2)),
            rng.choice((1, 1, 2)),
        ]
        decode_tp = rng.choice((1, 2, 2, 4))
        decode_pp = rng.choice((1, prefill[2]))
        decode_dp = rng.choice((1, 1, 2))
        policy = rng.choice((AllocationPolicy.EARLY, AllocationPolicy.PREFILL_COMPLETE))
        sizes_ok = (
            prefill[0] * prefill[1] * prefill[2] * prefill[3] <= MAX_RANKS_PER_SIDE
            and decode_tp * decode_pp * decode_dp <= MAX_RANKS_PER_SIDE
        )
        # PrefillComplete keeps one waiting decode endpoint per room and prefill rank, so the
        # policy needs each prefill rank to feed one decode rank (decode TP <= prefill TP).
        policy_ok = policy is AllocationPolicy.EARLY or decode_tp <= prefill[0]
        if sizes_ok and policy_ok:
            break
    return WorldShape(
        prefill_tp=prefill[0],
        prefill_cp=prefill[1],
        prefill_pp=prefill[2],
        prefill_dp=prefill[3],
        decode_tp=decode_tp,
        decode_pp=decode_pp,
        decode_dp=decode_dp,
        is_mla=rng.random() < 0.4,
        policy=policy,
        verify_checksums=rng.random() < 0.5,
        page_tokens=4,
        decode_pages=rng.choice((8, 12, 16)),
        source_pages=64,
        bootstrap_timeout=rng.choice((10.0, 30.0)),
        waiting_timeout=rng.choice((10.0, 30.0)),
    )


def draw_plan(seed: int) -> FaultPlan:
    """The whole plan for ``seed``; the same seed always gives the same plan."""
    rng = random.Random(seed)
    shape = draw_shape(rng)
    weights: dict[str, float] = {}
    drawn_later = {*LATE_KINDS, *LAST_KINDS, *NEWEST_KINDS, *WINDOW_KINDS, *HOST_KINDS}
    for kind in ACTION_KINDS:
        if kind in drawn_later:
            continue
        if kind in FAULT_KINDS:
            # Swarm testing: each fault is switched off for some seeds and frequent in others.
            weights[kind] = 0.0 if rng.random() < 0.3 else rng.choice((0.05, 0.15, 0.4))
        else:
            weights[kind] = rng.choice((1.0, 2.0, 3.0))
    # Time passing fires timeouts: frequent enough to reach them, rare enough to let work finish.
    weights["advance"] = rng.choice((0.3, 0.6, 1.0))
    if not shape.verify_checksums:
        weights["write_corrupt"] = 0.0  # silent corruption is undetectable without checksums
    reorder = rng.random() < 0.5
    max_open = rng.choice((2, 4, 6))
    room_reuse = rng.random() < 0.6
    # Drawn last, so the rest of every earlier seed's plan is unchanged.
    sends_checksums = rng.random() < 0.7
    shape = msgspec.structs.replace(
        shape,
        prefill_checksums=sends_checksums or shape.verify_checksums,
        prefill_declares_checksums=rng.random() < 0.5,
    )
    shape = msgspec.structs.replace(shape, receiver_fence=rng.random() < 0.7)
    for kind in LATE_KINDS:
        weights[kind] = 0.0 if rng.random() < 0.3 else rng.choice((0.05, 0.15, 0.4))
    (profile,) = rng.choices(list(PROFILE_WEIGHTS), list(PROFILE_WEIGHTS.values()))
    for kind in FAULT_KINDS - FAULT_PROFILES[profile]:
        weights[kind] = 0.0
    if profile == "data_path":
        # Few kinds of trouble, each met often: a write fails or arrives corrupt about as
        # often as it lands whole.
        for kind in ("write_fail", "write_corrupt"):
            weights[kind] *= 5
    if profile == "room_races":
        # Likewise an engine abort, about as often as an engine step: one that lands while
        # the room verifies is the race the release ledger must hold its pages through.
        for kind in ("abort_prefill", "abort_decode"):
            weights[kind] *= 5
    if not FAULT_PROFILES[profile] & LIVENESS_FAULTS:
        # Without a fault a heartbeat could notice, probing only slows the rooms down.
        weights["heartbeat_ok"] *= 0.1
    for kind in LAST_KINDS:
        drawn = 0.0 if rng.random() < 0.3 else rng.choice((0.05, 0.15, 0.4))
        weights[kind] = drawn if kind in FAULT_PROFILES[profile] else 0.0
    if rng.random() < 0.25:
        # The ready table's cap (prefill_complete) takes the same draw (a new one would move
        # every recorded seed's world), doubled: at the drawn value itself a refused bootstrap
        # waits out its timeout so often that seed 54's world saw no decode Success; doubled,
        # the uncapped table still passes it within a few seeds (mutant ready_table_uncapped).
        bound = rng.choice((1, 2))
        shape = msgspec.structs.replace(
            shape, max_pending_room_ids=bound, max_parked_peers=1,
            max_ownerless_ready_rooms=2 * bound,
        )  # fmt: skip
    if rng.random() < 0.3:
        shape = msgspec.structs.replace(shape, max_finished_room_ids=rng.choice((1, 2)))
    shape = msgspec.structs.replace(shape, announces_layout=rng.random() < 0.5)
    for kind in NEWEST_KINDS:
        if kind == "resume_prefill":  # as ordinary as any engine step
            weights[kind] = rng.choice((1.0, 2.0, 3.0))
        else:
            drawn = 0.0 if rng.random() < 0.3 else rng.choice((0.05, 0.15, 0.4))
            weights[kind] = drawn if kind in FAULT_PROFILES[profile] else 0.0
    for kind in WINDOW_KINDS:
        # Weighted like a few engine steps, but enabled only while its window is open: then it
        # often beats the step that closes the window.
        drawn = 0.0 if rng.random() < 0.2 else rng.choice((2.0, 4.0, 8.0))
        weights[kind] = drawn if kind in FAULT_PROFILES[profile] else 0.0
    if shape.verify_checksums and rng.random() < CHECKSUM_MISMATCH_SHARE:
        shape = msgspec.structs.replace(shape, prefill_checksums=False)
    for kind in HOST_KINDS:
        drawn = 0.0 if rng.random() < 0.3 else rng.choice((0.05, 0.15, 0.4))
        weights[kind] = drawn if kind in FAULT_PROFILES[profile] else 0.0
    return FaultPlan(
        seed=seed,
        shape=shape,
        weights=weights,
        reorder_within_link=reorder,
        max_open_requests=max_open,
        room_reuse=room_reuse,
        profile=profile,
    )
