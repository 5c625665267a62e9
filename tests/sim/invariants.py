"""What must hold once a schedule has run and the node has gone quiet.

Checked against the database (read-only), the oracle's counter table
(:mod:`tests.sim.observed`) and the schedule itself:

1. every emitted event has its runs (one per function its name triggers),
   and a repeat with the same idempotency key is the same event;
2. every run ended: completed, cancelled by the schedule, or failed for a
   reason the schedule explains (its plan's failure, its retries spent, the
   recovery ceiling it reached);
3. every step is recorded exactly once: a completed run has every step of
   its handler, each with the output first accepted for it (never
   overwritten), and one ``step.completed`` audit record per step;
4. no write was accepted from a fenced execution (judged during the run);
5. attempt and recovery_count agree with the counter table (a nack spends
   no attempt; a lost worker spends no attempt and counts toward the
   ceiling; a yield starts the count again) and with the audit trail;
6. the ceiling holds;
7. the two recovery loops never recovered the same run (judged during the run);
8. nothing is left behind: no lease, queue row or parked step of an ended
   run, and no wake listener of a stopped waker on the store;
9. an event acknowledged after the segment that parks a wait began (its
   ingest committed after the segment's reservation committed: the worker
   may start once it has the assignment), and before the wait's timeout (by
   the database clock), that matches it resolves it; and a wait is resolved
   only by an event that matches it;
10. at no instant do a function's leases and reservations (per key, for a
    keyed constraint) outnumber its concurrency limit (judged at every
    reservation, :mod:`tests.sim.limits`);
11. a throttled function's first starts conform to its GCRA, by the
    database clock, in commit order (:mod:`tests.sim.limits`);
12. a singleton function never has two runs in flight (not ended), and an
    event it skipped named a run then in flight (:mod:`tests.sim.limits`);
13. a cron schedule starts at most one run per tick, none before its time,
    none for a missed tick its catch-up policy does not fire, and one for
    every tick a node was up to fire at most ``cron_missed_after_s`` late
    (and every missed tick its policy fires) (:mod:`tests.sim.ticks`);
14. a rate-limited function's events that started runs, in commit order,
    conform to its GCRA; one that started none was skipped by the rate limit
    (its flow note says so), and would not have conformed
    (:mod:`tests.sim.limits`);
15. a debounced function's events each joined a run or opened the next
    quiet period's, as the period and max_wait allow; a run carries its
    period's last event and starts no earlier than the period's end
    (:mod:`tests.sim.limits`).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from ironflow.protocol import lookup_path
from ironflow.protocol.cron import CRON_EVENT
from tests.sim.ticks import CRON_PLAN
from tests.sim.worker import handler_plan, program, step_id

if TYPE_CHECKING:
    from tests.sim.simulator import Simulation

MAX_ATTEMPTS = {"sim-a": 3, "sim-b": 2, "sim-r": 2, "sim-s": 2, "sim-c": 2, "sim-l": 3, "sim-d": 3, "sim-t": 3}


def check(sim: Simulation) -> None:
    from tests.sim.limits import _functions
    from tests.sim.simulator import TRIGGERED

    o = sim.oracle
    bad = o.violation
    ceiling = int(sim.schedule.timings.recovery_ceiling)

    # 1. events → runs
    # A debounced function's runs move from event to event, a batch's run
    # holds several (invariants 15 and 16 judge them): left out here.
    debounced = tuple(sorted(
        fid for fid, fd in _functions().items() if fd.debounce is not None or fd.batch is not None
    ))
    runs_of_event: dict[str, list[str]] = {}
    for run_id, event_id, function_id in o.all("SELECT id, event_id, function_id FROM runs ORDER BY id"):
        if function_id not in debounced:
            runs_of_event.setdefault(event_id, []).append(run_id)
    emitted = {k for a in sim.schedule.actions if a.kind in ("emit", "emit_again") for k in [a.target]}
    emitted |= {k for a in sim.schedule.actions if a.kind == "worker_stall" for k, _ in a.arg[1]}
    known_events = set()
    for k in sorted(emitted):
        event_id = sim.event_ids.get(k)
        if event_id is None:
            bad(f"event {k} was never accepted")
            continue
        known_events.add(event_id)
        name = sim.schedule.events[k][0]
        row = o.one("SELECT run_ids, flow FROM events WHERE id = ?", (event_id,))
        stored = json.loads(row[0]) if row and row[0] else []
        if stored:
            stored = [r for (r,) in o.all(
                f"SELECT id FROM runs WHERE id IN ({', '.join('?' * len(stored))})"
                f" AND function_id NOT IN ({', '.join('?' * len(debounced))})", (*stored, *debounced)
            )]
        # A singleton's or a rate limit's skip (invariants 12 and 14 judge
        # them) starts no run of its function.
        skipped = {
            note["function_id"] for note in (json.loads(row[1]) if row and row[1] else [])
            if note["outcome"] == "skipped" and note["mechanism"] in ("singleton", "rate_limit")
        }
        expected = sorted(f for f in TRIGGERED[name] if f not in skipped and f not in debounced)
        functions = sorted(
            f for (f,) in o.all(
                f"SELECT function_id FROM runs WHERE id IN ({', '.join('?' * len(stored))})", tuple(stored)
            )
        ) if stored else []
        if functions != expected or sorted(stored) != sorted(runs_of_event.get(event_id, [])):
            bad(f"event {k} ({name}) has runs {stored} of {functions}; expected one of each of {expected}")
    # A cron tick's event and run are invariant 13's (tests/sim/ticks.py).
    ticks = {event_id for (event_id,) in o.all("SELECT id FROM events WHERE name = ?", (CRON_EVENT,))}
    for event_id in sorted(runs_of_event):
        if event_id not in known_events and event_id not in ticks:
            bad(f"runs {runs_of_event[event_id]} belong to no emitted event ({event_id})")

    # 2–6, run by run
    event_plan = {sim.event_ids[k]: sim.schedule.events[k][1] for k in sim.event_ids}
    event_plan.update(dict.fromkeys(ticks, CRON_PLAN))
    for run_id, function_id, event_id, status, attempt, recovery_count, error_text, output_text in o.all(
        "SELECT id, function_id, event_id, status, attempt, recovery_count, error, output FROM runs ORDER BY id"
    ):
        c = o.run(run_id)
        plan = event_plan.get(event_id)
        if plan is None:
            continue
        plan = handler_plan(function_id, plan)
        error = json.loads(error_text) if error_text else None
        code = error["code"] if error else None
        where = f"run {run_id} ({function_id}, event k={plan['k']})"
        if status not in ("completed", "failed", "cancelled"):
            held = o.one(
                "SELECT (SELECT count(*) FROM dispatch_queue WHERE run_id = ?),"
                " (SELECT count(*) FROM concurrency_leases WHERE run_id = ?),"
                " (SELECT count(*) FROM steps WHERE run_id = ? AND status IN ('sleeping', 'waiting', 'waking'))",
                (run_id, run_id, run_id),
            )
            stranded = held is not None and not any(held)
            queued = o.one(
                "SELECT q.execution_seq, r.current_execution_seq, q.eligible_at, q.reason,"
                " q.reservation_owner, q.reservation_expires_at,"
                " EXISTS (SELECT 1 FROM worker_sessions s WHERE s.id = q.reservation_owner)"
                " FROM dispatch_queue q JOIN runs r ON r.id = q.run_id WHERE q.run_id = ?",
                (run_id,),
            )
            now = sim.epoch_now()
            detail = "" if queued is None else (
                f"; queue row: seq {queued[0]} (run's {queued[1]}), eligible {float(queued[2]) - now:+.1f} s,"
                f" reason {queued[3]}, reserved by {queued[4]} (session exists: {bool(queued[6])}),"
                f" expiring {'-' if queued[5] is None else f'{float(queued[5]) - now:+.1f} s'}"
            )
            bad(
                f"{where} did not end: {status} after the node went quiet"
                + (" (stranded: no queue row, no lease, no parked step)" if stranded else f" (queue, lease, parked: {held}{detail})")
            )
            continue
        steps = {
            sid: (kind, st, out)
            for sid, kind, st, out in o.all(
                "SELECT step_id, kind, status, output FROM steps WHERE run_id = ?", (run_id,)
            )
        }
        fail = plan.get("fail")
        max_attempts = MAX_ATTEMPTS[function_id]
        if status == "completed":
            if c.ended_by != "completed":
                bad(f"{where} completed, but no accepted JobCompleted was seen (oracle: {c.ended_by})")
            if fail is not None and attempt in fail["attempts"]:
                bad(f"{where} completed at attempt {attempt}, where its plan fails")
            if json.loads(output_text) != {"k": plan["k"], "steps": len(plan["durations"])}:
                bad(f"{where} completed with output {output_text}")
            for kind, name, _ in program(plan):
                sid = step_id(run_id, name)
                got = steps.get(sid)
                ok = {"run": ("completed",), "sleep": ("completed",), "wait": ("completed", "timed_out")}[kind]
                if got is None or got[1] not in ok:
                    bad(f"{where} completed without its step {name} recorded ({got})")
        elif status == "cancelled":
            if not c.cancelled:
                bad(f"{where} cancelled, but the schedule never cancelled it")
        else:
            explained = set()
            if c.exhausted:
                explained.add("EXECUTION_RECOVERY_EXHAUSTED")
            if fail is not None and not fail["retryable"] and 1 in fail["attempts"]:
                explained.add("SIM_FATAL")
            if fail is not None and fail["retryable"] and max_attempts in fail["attempts"] and attempt == max_attempts:
                explained.add("SIM_RETRYABLE")
            if code not in explained or c.ended_by != code:
                bad(f"{where} failed with {code}; the schedule explains {sorted(explained)} (oracle: {c.ended_by})")
        # 3. steps: the first accepted output, never overwritten
        for sid, (kind, st, out) in sorted(steps.items()):
            if kind != "run" or st != "completed":
                continue
            if sid not in c.steps:
                bad(f"{where}: step {sid} recorded, but no accepted write of it was seen")
            elif json.loads(out) != c.steps[sid]:
                bad(f"{where}: step {sid} holds {out}, but its first accepted output was {c.steps[sid]}")
        # 5. counters vs the runs table
        if attempt != 1 + c.retries:
            bad(f"{where}: attempt {attempt}, but the counter table has {c.retries} retries")
        if recovery_count != c.consecutive:
            bad(f"{where}: recovery_count {recovery_count}, the counter table says {c.consecutive}")
        # 6. the ceiling
        if recovery_count > ceiling:
            bad(f"{where}: recovery_count {recovery_count} beyond the ceiling {ceiling}")
        if (code == "EXECUTION_RECOVERY_EXHAUSTED") != c.exhausted:
            bad(f"{where}: exhausted={c.exhausted} in the counter table, error {code}")
        # 5. counters vs the audit trail
        audit = o.all("SELECT type, data FROM audit_log WHERE run_id = ? ORDER BY at, id", (run_id,))
        kinds = Counter(t for t, _ in audit)
        expired = [json.loads(d) for t, d in audit if t == "capacity.lease.expired"]
        trail = [(e["recovery_count"], e["ceiling_reached"]) for e in expired]
        want = {
            "capacity.lease.expired": len(c.recoveries),
            "capacity.segment.recovered": sum(1 for _, x in c.recoveries if not x),
            "capacity.job.nacked": c.nacks,
            "run.started": c.activations,
            "run.attempt.failed": c.retries,
            "run.completed": int(status == "completed"),
            "run.failed": int(status == "failed"),
            "run.cancelled": int(status == "cancelled"),
        }
        for kind, n in want.items():
            if kinds[kind] != n:
                bad(f"{where}: {kinds[kind]} '{kind}' audit records, the counter table says {n}")
        if trail != c.recoveries:
            bad(f"{where}: audit recovery trail {trail}, the counter table says {c.recoveries}")
        step_audits = Counter(json.loads(d)["step_id"] for t, d in audit if t == "step.completed")
        recorded = {sid for sid, (kind, st, _) in steps.items() if kind == "run" and st == "completed"}
        if set(step_audits) != recorded or any(n != 1 for n in step_audits.values()):
            bad(f"{where}: step.completed audit {dict(step_audits)} vs steps recorded {sorted(recorded)}")

    # 8. nothing left behind
    for table in ("concurrency_leases", "dispatch_queue"):
        row = o.one(
            f"SELECT count(*) FROM {table} t JOIN runs r ON r.id = t.run_id"
            " WHERE r.status IN ('completed', 'failed', 'cancelled')"
        )
        if row and row[0]:
            bad(f"{row[0]} rows of {table} belong to ended runs")
    row = o.one(
        "SELECT count(*) FROM steps s JOIN runs r ON r.id = s.run_id"
        " WHERE r.status IN ('completed', 'failed', 'cancelled')"
        " AND s.status IN ('sleeping', 'waiting', 'waking')"
    )
    if row and row[0]:
        bad(f"{row[0]} parked steps belong to ended runs")
    for store in sim.real_stores:
        listeners: Any = getattr(store, "_wake_listeners", [])
        if listeners:
            bad(f"{len(listeners)} wake listeners of stopped wakers are still registered on the store")

    check_waits(sim)
    o.flow.check_throttles()
    o.flow.check_rate_limits()
    o.flow.check_debounces()
    o.flow.check_batches()
    sim.ticks.check(sim)


def _matches(data: Any, match: str | None, value: Any) -> bool:
    return match is None or lookup_path(data, match) == value


def check_waits(sim: Simulation) -> None:
    """9. Every wait's last park, against the events of its name."""
    from tests.sim.simulator import BASE

    o = sim.oracle
    for (run_id, seq), park in sorted(o.parks.items()):
        sid = step_id(run_id, "signal")
        row = o.one(
            "SELECT s.status, s.execution_seq, s.output, r.status, r.ended_at FROM steps s"
            " JOIN runs r ON r.id = s.run_id WHERE s.run_id = ? AND s.step_id = ?",
            (run_id, sid),
        )
        if row is None or int(row[1]) != seq:
            continue  # parked again by a later segment: that park is judged
        status, _, output_text, run_status, ended_at = row
        if status == "completed":
            got = json.loads(output_text)
            if not _matches(got["data"], park.match, park.match_value):
                o.violation(f"wait {sid} (seq {seq}) resolved by {got['id']}, which does not match it")
            continue
        until = park.timeout_at
        if run_status != "completed" and ended_at is not None:
            until = min(until, float(ended_at))  # nothing to resolve once the run ended
        for event_id, data_text, received_at in o.all(
            "SELECT id, data, received_at FROM events WHERE name = ? AND received_at < ?"
            " ORDER BY received_at",
            (park.event, until),
        ):
            # "After the segment began": its ingest committed after the commit
            # that reserved the segment (by the clock where that is unknown).
            ingest = o.ingests.get(event_id)
            after = (
                ingest[1] > park.began
                if ingest is not None and park.began is not None
                else float(received_at) >= park.segment_began
            )
            if after and _matches(json.loads(data_text), park.match, park.match_value):
                o.violation(
                    f"wait {sid} of run {run_id} (parked by seq {seq}, segment began"
                    f" {park.segment_began - BASE:.3f}) ended {status}, but event {event_id}"
                    f" matching it was received at {float(received_at) - BASE:.3f},"
                    f" before its timeout {park.timeout_at - BASE:.3f}: {_how(park, o.ingests.get(event_id))}"
                )
                break


def _how(park: Any, ingest: tuple[int, int] | None) -> str:
    """Which interleaving lost the event, by the transactions' numbers."""
    if ingest is None or not park.committed:
        return "lost"
    begun, committed = ingest
    if park.committed < begun:
        return "lost by an ingest that began after the park committed (a wait row skipped)"
    if committed < park.begun:
        return "lost by a park that began after the ingest committed (the look-back missed it)"
    return "lost between a park and an ingest that overlapped"

