"""Loop 1 — the capacity scanner (seed: docs/seeds/crash-recovery.txt).

Every ``scanner_interval`` — and also exactly at the earliest known expiry, so
that no scan tick is added to recovery latency — it:

- frees expired reservations (the worker died after admission, before acking);
- fences expired leases: the run's execution_seq is bumped, the audit pair
  ``capacity.lease.expired`` / ``capacity.segment.recovered`` is recorded and
  the segment is re-enqueued with ``eligible_at = now + recovery_grace`` — or
  the run fails with EXECUTION_RECOVERY_EXHAUSTED past the recovery ceiling;
- deletes expired worker sessions, cascading to their credits (their leases
  expire on their own clock);
- fails runs past their function's timeout (``FUNCTION_TIMEOUT``, counted from
  the first start), so the timeout holds even when no worker is alive.

Expiry is decided by the database clock, so a dead node's sessions and leases
are reaped by any surviving node's scanner.
"""

from __future__ import annotations

import logging

import trio

from actors.messages import Kick, kick
from actors.recovered import note_recovered
from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.engine import metrics
from ironflow.store import Store

log = logging.getLogger("ironflow.capacity")

# Wake this long after the earliest expiry: expiry is `expires_at <= now` in
# SQL, so the database clock must have reached it; the slack absorbs float
# rounding and any drift between the database clock and Trio's.
EXPIRY_SLACK_S = 0.005


async def scan_once(store: Store, config: NodeConfig, kicks: trio.MemorySendChannel[Kick]) -> int:
    """One pass over the three expiry clocks; returns how many things it reclaimed."""
    t = config.timings
    freed = await store.expire_reservations()
    recovered = await store.expire_leases(
        recovery_grace_s=t.recovery_grace_s, recovery_ceiling=int(t.recovery_ceiling)
    )
    sessions = await store.expire_sessions()
    timed_out = await store.expire_run_deadlines()
    for ended in timed_out:
        metrics.run_ended("failed", ended.function_id, ended.duration_s)
        logs.event(
            log, logging.WARNING, "run: function timeout reached, run failed",
            run_id=ended.run_id, session_id=ended.session_id, code="FUNCTION_TIMEOUT",
        )
    if freed:
        logs.event(log, logging.INFO, "capacity: reservations expired, slots freed", count=freed)
    for seg in recovered:
        note_recovered(
            log, seg, path="lease_expiry",
            message="capacity: lease expired, segment recovered",
            fields=dict(
                old_execution_seq=seg.old_execution_seq, execution_seq=seg.new_execution_seq,
                session_id=seg.session_id, recovery_count=seg.recovery_count, eligible_at=seg.eligible_at,
            ),
            exhausted_message="capacity: lease expired, recovery ceiling reached, run failed",
            exhausted_fields=dict(
                execution_seq=seg.old_execution_seq, recovery_count=seg.recovery_count,
                code="EXECUTION_RECOVERY_EXHAUSTED",
            ),
        )
    if sessions:
        logs.event(log, logging.INFO, "capacity: worker sessions expired", count=sessions)
    if freed or recovered or timed_out:
        kick(kicks, "capacity scan")  # freed credits; a parent of a timed-out child resumes
    return freed + len(recovered) + sessions + len(timed_out)


async def run(
    store: Store,
    config: NodeConfig,
    kicks: trio.MemorySendChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run loop 1 until cancelled. Sleeps use Trio's clock (MockClock in tests)."""
    interval = config.timings.scanner_interval_s
    task_status.started()
    while True:
        await scan_once(store, config, kicks)
        next_expiry = await store.seconds_until_next_capacity_expiry()
        delay = interval
        if next_expiry is not None:
            delay = min(interval, max(next_expiry, 0.0) + EXPIRY_SLACK_S)
        await trio.sleep(delay)
