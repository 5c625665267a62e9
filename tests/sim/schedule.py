"""A seed → the whole fault schedule of one simulated node, drawn up front.

Everything random in a simulation comes from here or from RNGs derived from
the same seed (:func:`rng_for`): the node's settings, the workers, the
events, the handlers' plans, the timed faults and each link's per-frame
faults. Printing a :class:`Schedule` shows what the seed will do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ironflow.config import Timings

# Virtual seconds during which faults and events are injected; then the
# network heals, frozen workers thaw, every worker slot is running again and
# the simulation waits (up to QUIESCE_LIMIT_S) for every run to end.
FAULT_PHASE_S = (20.0, 40.0)
QUIESCE_LIMIT_S = 1500.0

# Actors the schedule may crash through the supervisor's crash hook.
CRASHABLE = (
    "dispatcher",
    "capacity-scanner",
    "waker",
    "stale-claim-sweeper",
    "node-heartbeat",
    "janitor",
    "metrics-sampler",
    "kick-listener",
    "drain-coordinator",
)
# "Crash the actor that made this store call, right after it returns": hits
# the windows between two transactions of one actor (a claimed step not yet
# resumed, a reservation not yet handed over) that a timed crash rarely finds.
CRASH_AFTER = {
    "claim_elapsed_steps": "waker",
    "reserve_segments": "dispatcher",
    "expire_leases": "capacity-scanner",
    "reset_stale_claims": "stale-claim-sweeper",
}

TIMED_FAULTS = (
    "worker_crash",
    "worker_freeze",
    "conn_cut",
    "late_heartbeat",
    "worker_drain",
    "actor_crash",
    "node_restart",
    "node_crash",
    "node_drain",
    "cancel",
)

# What each emitted event is called (its plan rides in its data): "both.go"
# starts a run of each function, the others one.
EVENT_NAMES = ("a.go", "b.go", "both.go")


def rng_for(seed: int, *parts: object) -> random.Random:
    """An RNG of its own for one component, derived from the seed (string-seeded:
    independent of PYTHONHASHSEED)."""
    return random.Random(":".join([str(seed), *map(str, parts)]))


@dataclass(frozen=True)
class Action:
    at: float
    kind: str
    target: Any = None
    arg: Any = None

    def __str__(self) -> str:
        extra = "".join(f" {x}" for x in (self.target, self.arg) if x is not None)
        return f"t={self.at:7.3f} {self.kind}{extra}"


@dataclass(frozen=True)
class FrameFaults:
    """Per-frame fault probabilities of every link of the seed."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    reorder: float = 0.0
    max_delay_s: float = 3.0

    def __str__(self) -> str:
        return (
            f"drop={self.drop:.3f} duplicate={self.duplicate:.3f} delay={self.delay:.3f}"
            f" (≤{self.max_delay_s:.1f}s) reorder={self.reorder:.3f}"
        )


@dataclass
class Schedule:
    seed: int
    timings: Timings
    workers: list[int]  # slots per worker
    frame_faults: FrameFaults
    fault_phase_s: float
    actions: list[Action] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (name, plan) by k
    crash_after: list[tuple[str, int]] = field(default_factory=list)  # (store method, n-th call)
    node_crash_after: list[tuple[str, int]] = field(default_factory=list)

    def describe(self) -> str:
        t = self.timings
        lines = [
            f"seed {self.seed}: {len(self.workers)} workers (slots {self.workers}),"
            f" fault phase {self.fault_phase_s:.1f}s, recovery ceiling {t.recovery_ceiling},"
            f" lease {t.lease_expiry_s:g}s, heartbeat {t.heartbeat_interval_s:g}s",
            f"  frames: {self.frame_faults}",
        ]
        if self.crash_after:
            lines.append("  crash after: " + ", ".join(f"{m}#{n}" for m, n in self.crash_after))
        if self.node_crash_after:
            lines.append(
                "  node crash after: " + ", ".join(f"{m}#{n}" for m, n in self.node_crash_after)
            )
        lines += [f"  event {k}: {name} {plan}" for k, (name, plan) in enumerate(self.events)]
        lines += [f"  {a}" for a in self.actions]
        return "\n".join(lines)


# Groups of sim-b's concurrency key (``event.data.g``): few, so runs of one
# group often overlap and its limit binds.
FLOW_GROUPS = 2


def plan_for(rng: random.Random, k: int, max_attempts: int) -> dict[str, Any]:
    """What one run's handler does (carried in its event's data, so a worker
    knows it from the assignment alone): ``steps`` step.run calls of the given
    durations, maybe a durable sleep or a wait_for_event at some index, and
    maybe a failure at one attempt (retryable or not) or at every attempt."""
    n = rng.randint(1, 4)
    plan: dict[str, Any] = {
        "k": k,
        "durations": [round(rng.uniform(0.1, 2.5), 3) for _ in range(n)],
        # sim-b's concurrency key (one run per group at a time): no draw, so
        # the rest of the schedule is what it was before.
        "g": k % FLOW_GROUPS,
    }
    r = rng.random()
    if r < 0.25:
        plan["sleep"] = [rng.randint(0, n), round(rng.uniform(0.5, 8.0), 3)]
    elif r < 0.45:
        plan["wait"] = [rng.randint(0, n), round(rng.uniform(3.0, 20.0), 3)]
    r = rng.random()
    if r < 0.15:
        plan["fail"] = {"attempts": [1], "step": rng.randint(0, n - 1), "retryable": True}
    elif r < 0.2:
        plan["fail"] = {
            "attempts": list(range(1, max_attempts + 1)),
            "step": rng.randint(0, n - 1),
            "retryable": True,
        }
    elif r < 0.25:
        plan["fail"] = {"attempts": [1], "step": rng.randint(0, n - 1), "retryable": False}
    return plan


# Race runs (function sim-r, event "r.go"): one step, then a wait_for_event on
# "race.go" matching its own key. Once a worker begins the step, the run's
# matching event and RACE_OTHERS non-matching ones of the same name are
# emitted at once, RACE_AFTER_S (or the step's duration) later: while the
# segment runs, at the very moment it parks the wait, or just after.
RACE_RUNS = (1, 4)
RACE_OTHERS = (1, 3)
RACE_LATE_S = 0.05
# Keys of the non-matching events: no run has them.
RACE_STRAY_KEY = 1000


def race_plan(rng: random.Random, k: int) -> dict[str, Any]:
    """A race run's plan (see RACE_RUNS): its step, its wait, and when the
    events for it are emitted after the step begins."""
    d = round(rng.uniform(0.1, 2.5), 3)
    when = rng.choice(["during", "at_park", "at_park", "after"])
    after_s = {
        "during": round(rng.uniform(0.0, d), 3),
        "at_park": d,  # the same virtual instant as the yield: the two transactions overlap
        "after": round(d + rng.uniform(0.0, RACE_LATE_S), 3),
    }[when]
    others = [RACE_STRAY_KEY + 10 * k + j for j in range(rng.randint(*RACE_OTHERS))]
    return {
        "k": k,
        "durations": [d],
        "wait": [1, round(rng.uniform(3.0, 20.0), 3)],
        "wait_event": "race.go",
        "race": {"when": when, "after_s": after_s, "others": others},
    }


# Worker stalls (their own RNG): the worker with the most slots freezes until
# just past its session's expiry, while a burst of events is emitted shortly
# before that expiry, so it is assigned several runs and acks them only after
# its session was removed, while their reservations still stand.
STALL_CHANCE = 0.5
EMIT_CRASH_CHANCE = 0.25
STALL_PAST_EXPIRY_S = (0.2, 1.0)
STALL_BURST = (3, 6)
STALL_BURST_BEFORE_EXPIRY_S = (1.0, 3.5)


def build(seed: int) -> Schedule:
    rng = rng_for(seed, "schedule")
    timings = Timings(
        heartbeat_interval_s=3.0,
        session_expiry_s=9.0,
        scanner_interval_s=10.0,
        reservation_expiry_s=5.0,
        lease_expiry_s=9.0,
        recovery_grace_s=round(rng.uniform(0.2, 2.0), 3),
        recovery_ceiling=rng.choice([1, 2, 3, 5]),
        stale_claim_interval_s=5.0,
        stale_claim_threshold_s=10.0,
        waker_interval_s=10.0,
        drain_timeout_s=round(rng.uniform(2.0, 10.0), 3),
        node_heartbeat_s=30.0,
        dispatch_idle_poll_s=10.0,
        metrics_sample_s=30.0,
        restart_backoff_s=0.05,
        restart_backoff_max_s=2.0,
        history_retention_s=0.0,  # keep everything: the audit trail is checked at the end
        janitor_interval_s=60.0,
        # Off, the usual, or as long as the reservation expiry allows.
        waker_lookahead_s=rng.choice([0.0, 1.0, 2.5]),
    )
    workers = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 3))]
    calm = rng.random() < 0.2  # some seeds keep the wire clean
    ff = FrameFaults(
        drop=0.0 if calm else rng.choice([0.0, 0.01, 0.03, 0.08]),
        duplicate=0.0 if calm else rng.choice([0.0, 0.01, 0.03, 0.08]),
        delay=0.0 if calm else rng.choice([0.0, 0.02, 0.05]),
        reorder=0.0 if calm else rng.choice([0.0, 0.02, 0.05]),
        max_delay_s=rng.choice([1.0, 3.0, 9.0]),
    )
    phase = round(rng.uniform(*FAULT_PHASE_S), 3)
    sched = Schedule(seed, timings, workers, ff, phase)

    def at() -> float:
        return round(rng.uniform(0.0, phase), 3)

    events = rng.randint(2, 7)
    for k in range(events):
        name = rng.choices(EVENT_NAMES, weights=(4, 4, 2))[0]
        sched.events.append((name, plan_for(rng, k, 3)))
        sched.actions.append(Action(at(), "emit", k))
        if rng.random() < 0.1:  # the same event again, with its idempotency key
            sched.actions.append(Action(at(), "emit_again", k))
        if rng.random() < 0.4:  # the signal a wait_for_event of run k may be waiting for
            sched.actions.append(Action(at(), "signal", k))
    for _ in range(rng.randint(0, 8)):
        kind = rng.choice(TIMED_FAULTS)
        if kind in ("worker_crash", "conn_cut", "worker_drain"):
            sched.actions.append(Action(at(), kind, rng.randrange(len(workers))))
        elif kind == "worker_freeze":
            d = round(rng.uniform(timings.lease_expiry_s + 0.5, 3 * timings.session_expiry_s), 3)
            sched.actions.append(Action(at(), kind, rng.randrange(len(workers)), d))
        elif kind == "late_heartbeat":
            d = round(rng.uniform(1.0, 2.5 * timings.lease_expiry_s), 3)
            sched.actions.append(Action(at(), kind, rng.randrange(len(workers)), d))
        elif kind == "actor_crash":
            sched.actions.append(Action(at(), kind, rng.choice(CRASHABLE)))
        elif kind == "cancel":
            sched.actions.append(Action(at(), kind, rng.randrange(events)))
        else:
            sched.actions.append(Action(at(), kind))
    for _ in range(rng.choice([0, 0, 1, 2])):
        sched.crash_after.append((rng.choice(sorted(CRASH_AFTER)), rng.randint(1, 6)))
    if rng.random() < 0.1:
        sched.node_crash_after.append(
            (rng.choice(["claim_elapsed_steps", "reserve_segments", "yield_job"]), rng.randint(1, 4))
        )
    # Drawn last, from an RNG of their own: the rest of a seed's schedule is
    # what it was before race runs existed.
    races = rng_for(seed, "races")
    for _ in range(races.randint(*RACE_RUNS)):
        k = len(sched.events)
        sched.events.append(("r.go", race_plan(races, k)))
        sched.actions.append(Action(round(races.uniform(0.0, phase), 3), "emit", k))
    stalls = rng_for(seed, "stalls")
    if stalls.random() < STALL_CHANCE and max(workers) >= 3:
        at_s = round(stalls.uniform(0.0, phase * 0.6), 3)
        slot = workers.index(max(workers))
        burst = []
        for _ in range(stalls.randint(*STALL_BURST)):
            k = len(sched.events)
            sched.events.append(("a.go", {"k": k, "durations": [round(stalls.uniform(0.1, 1.0), 3)]}))
            burst.append((k, round(stalls.uniform(*STALL_BURST_BEFORE_EXPIRY_S), 3)))
        # (how long past its session's expiry it stays frozen, [(event, seconds before that expiry)])
        sched.actions.append(
            Action(at_s, "worker_stall", slot, (round(stalls.uniform(*STALL_PAST_EXPIRY_S), 3), burst))
        )
    # A node crash right after an emit's reservation committed, before it
    # is handed out (the API's ingest_and_reserve; from an RNG of its own).
    emit_crash = rng_for(seed, "emit-crash")
    if emit_crash.random() < EMIT_CRASH_CHANCE:
        sched.node_crash_after.append(("ingest_and_reserve", emit_crash.randint(1, 2)))
    sched.actions.sort(key=lambda a: (a.at, a.kind, str(a.target)))
    return sched
