"""The oracle's view of cron schedules (docs/schedules.md): invariant 13 of
:mod:`tests.sim.invariants`.

``sim-c`` runs on a 6-field schedule (:data:`CRON`: every 5 s of the first
20 s of virtual time), with a catch-up policy and window drawn per seed. Its runs
carry the ``ironflow.cron`` event of their tick; their handler runs no step
(:data:`CRON_PLAN`); they are judged by invariants 2–6 like any run.

13. **One run per tick, and every tick the engine owes.** From the schedule's
    first tick (its ``next_at`` once registered) to the end of the seed:

    - no tick has two runs, and no run is for a time that is not a tick of
      the schedule, or before its first, or created before its time by the
      database clock;
    - a run created more than ``cron_missed_after_s`` after its tick (a
      missed tick, fired by catch-up) is one its policy allows: never under
      ``none``; within the window under ``all``; under ``latest`` within the
      window and the latest tick at its creation;
    - every tick that an up node could have seen while it was at most
      ``cron_missed_after_s`` late has its run ("a tick at most 1.5 s late
      fires under every policy"); a missed tick has its run when its policy
      says so at the moment the first node came back (``all``: within the
      window; ``latest``: the latest tick then, within the window).

    "Up" is a node incarnation from the moment its actors started until it
    was asked to drain, crashed or stopped (a draining node may still fire:
    up is a lower bound). A tick is judged only when the moment a node could
    first see it is clearly inside or clearly outside each bound (MARGIN_S):
    no finding rests on a pass's exact instant.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ironflow.protocol import FunctionDef, RetryPolicy, Trigger
from ironflow.protocol.cron import CRON_EVENT, latest_tick, next_tick

if TYPE_CHECKING:
    from tests.sim.simulator import Simulation

CRON_FUNCTION = "sim-c"
# Every 5 s of the first 20 s of virtual time (0 is a whole hour:
# simulator.BASE), inside the fault phase (20-40 s): 4 ticks, so node
# restarts (down 0.2-3 s) now and then straddle one; then none for an hour, longer
# than any seed runs, so a seed's quiescence is not chased by new runs. Few
# ticks: each is a run, and the campaign's cost per seed is kept.
CRON = "0-20/5 0 * * * *"
# Per seed: the policy, and a window shorter or longer than a node's downtime.
CATCHUP_POLICIES = ("latest", "none", "all")
CATCHUP_WINDOWS_S = (2.5, 600.0)
# What a cron run's handler does (its event carries the tick, not a plan).
CRON_PLAN: dict[str, Any] = {"k": -1, "durations": []}
# Slack on a pass's instant: a node's scheduler passes when its actors start
# and TICK_SLACK_S after each tick; a pass another node's transaction holds up
# (SKIP LOCKED) retries after BUSY_RETRY_S. Ticks whose judgement would
# depend on less than this are not judged.
MARGIN_S = 0.25
# Slack on the database clock's float arithmetic.
CLOCK_SLACK_S = 1e-3


def cron_function(seed: int) -> FunctionDef:
    """``sim-c`` with the seed's catch-up policy and window (its own RNG: the
    rest of the seed's schedule is what it was without it)."""
    from tests.sim.schedule import rng_for

    rng = rng_for(seed, "cron")
    return FunctionDef(
        id=CRON_FUNCTION,
        triggers=[Trigger(cron=CRON, catchup=rng.choice(CATCHUP_POLICIES),
                          catchup_window_s=rng.choice(CATCHUP_WINDOWS_S))],
        retries=RetryPolicy(max_attempts=2, initial_delay_s=0.5),
        audit=True,
    )


@dataclass
class TickWatch:
    """Node incarnations' up spans (virtual time), the schedule's first tick,
    and the end of the seed."""

    fd: FunctionDef
    spans: list[list[float]] = field(default_factory=list)
    first_at: float | None = None  # epoch
    stop_at: float = math.inf  # virtual

    def node_up(self, now: float) -> list[float]:
        span = [now, math.inf]
        self.spans.append(span)
        return span

    @staticmethod
    def node_down(span: list[float] | None, now: float) -> None:
        if span is not None:
            span[1] = min(span[1], now)

    def first_seen(self, tick: float) -> float | None:
        """The earliest virtual instant at or after ``tick`` at which a node
        was up and stayed up MARGIN_S more (None: none before the end)."""
        best: float | None = None
        for a, b in self.spans:
            x = max(a, tick)
            if min(b, self.stop_at) - x >= MARGIN_S and (best is None or x < best):
                best = x
        return best

    def check(self, sim: Simulation) -> None:
        """13 (module docstring), from the runs and their ``ironflow.cron`` events."""
        from tests.sim.simulator import BASE

        o = sim.oracle
        trigger = self.fd.triggers[0]
        assert trigger.cron is not None
        cron, tz, policy, window = trigger.cron, trigger.timezone, trigger.catchup, trigger.catchup_window_s
        missed_after = sim.config.timings.cron_missed_after_s
        if self.first_at is None:
            o.violation(f"{CRON_FUNCTION}'s schedule was never registered")
            return
        runs: dict[float, list[tuple[str, float]]] = {}
        for run_id, created_at, name, data in o.all(
            "SELECT r.id, r.created_at, e.name, e.data FROM runs r JOIN events e ON e.id = r.event_id"
            " WHERE r.function_id = ? ORDER BY r.created_at, r.id",
            (CRON_FUNCTION,),
        ):
            tick = float(json.loads(data)["scheduled_at_epoch"]) if name == CRON_EVENT else math.nan
            runs.setdefault(tick, []).append((run_id, float(created_at)))
        end = BASE + self.stop_at
        for tick, fired in sorted(runs.items()):
            at = f"tick at {tick - BASE:.0f} s"
            if math.isnan(tick) or tick < self.first_at or latest_tick(cron, tz, tick) != tick:
                o.violation(f"{CRON_FUNCTION} runs {[r for r, _ in fired]} for no tick of its schedule ({at})")
                continue
            if len(fired) > 1:
                o.violation(f"{CRON_FUNCTION} {at} has {len(fired)} runs (one per tick): {[r for r, _ in fired]}")
            run_id, created = fired[0]
            late = created - tick
            o.counts["cron_runs"] += 1
            if late < -CLOCK_SLACK_S:
                o.violation(f"{CRON_FUNCTION} {at}: run {run_id} created {-late:.3f} s before its time")
            elif late > missed_after + CLOCK_SLACK_S:
                o.counts["cron_catchup_runs"] += 1
                allowed = policy != "none" and late <= window + CLOCK_SLACK_S and (
                    policy == "all" or latest_tick(cron, tz, created) == tick
                )
                if not allowed:
                    o.violation(
                        f"{CRON_FUNCTION} {at}: run {run_id} created {late:.3f} s late (missed),"
                        f" which catch-up {policy!r} (window {window:g} s) does not fire"
                    )
        tick = self.first_at
        while tick <= end:
            seen = self.first_seen(tick - BASE)
            if seen is not None:
                self._owed(sim, tick, BASE + seen, bool(runs.get(tick)), next_tick(cron, tz, tick),
                           policy, window, missed_after)
            tick = next_tick(cron, tz, tick)

    def _owed(
        self, sim: Simulation, tick: float, seen: float, fired: bool, following: float,
        policy: str, window: float, missed_after: float,
    ) -> None:
        """Judge a tick (``following``: the next one) that a node first could
        have fired at ``seen`` (epoch)."""
        from tests.sim.simulator import BASE

        o = sim.oracle
        late = seen - tick
        o.counts["cron_ticks_judged"] += 1
        if late <= missed_after - MARGIN_S:
            if not fired:
                o.violation(
                    f"{CRON_FUNCTION} tick at {tick - BASE:.0f} s has no run, though a node was up"
                    f" {late:.3f} s after it (a tick at most {missed_after:g} s late fires)"
                )
            return
        if late < missed_after + MARGIN_S:
            return  # late or missed: depends on the pass's instant
        o.counts["cron_ticks_missed"] += 1
        owed = {
            "none": False,
            "all": late <= window - MARGIN_S,
            "latest": late <= window - MARGIN_S and following > seen + MARGIN_S,
        }[policy]
        if owed and not fired:
            o.violation(
                f"{CRON_FUNCTION} tick at {tick - BASE:.0f} s, missed (the first node up {late:.3f} s"
                f" after it), has no run, though catch-up {policy!r} (window {window:g} s) fires it"
            )

