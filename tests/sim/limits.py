"""The oracle's view of flow control (docs/flow-control.md): invariants 10,
11 and 12 of :mod:`tests.sim.invariants`.

10. **Concurrency**: at no instant do a function's leases and reservations
    (of one key, for a keyed constraint) outnumber its limit. Only a
    reservation adds to that count, so it is read from the database right
    after every reservation call that reserved anything (one consistent read;
    on PostgreSQL another node's commits may come between, but any committed
    state must hold the limit too).
11. **Throttle**: the first reservations of a throttled function's runs,
    replayed in commit order at their own database time through a GCRA of
    the function's parameters, all conform. The oracle sees only the
    reservations whose call returned (a call cancelled after its commit is
    not seen): a subsequence of a conforming sequence conforms too, so
    missing some never makes a false finding.
12. **Singleton**: only an ingest creates runs, so after every ingest no
    singleton function has two runs not ended; and an event it skipped named
    a run that was in flight.
14. **Rate limit**: the events of a rate-limited function, in the commit
    order of their ingests (the order the ``rate_limits`` row's lock
    serialised them in), at their own database time (``received_at``):
    those that started a run, replayed through the GCRA of the declared
    limit and period, all conform; every one that started none has a flow
    note saying the rate limit skipped it; and (without concurrent nodes,
    when the oracle saw every ingest) none was skipped that would have
    conformed. An ingest whose call was cancelled after its commit is not
    seen (no commit number): the first two checks judge the events seen (a
    subsequence of conforming starts conforms), the third is then not made.
15. **Debounce**: every event of a debounced function has a note naming the
    run it joined or opened. Per run, its events in commit order: none
    joined after the run's first reservation committed; the run carries the
    last of them (``runs.event_id``, and the assignment's event at its first
    reservation); that reservation's database time is no earlier than the
    period's end, ``min(last + period, first + max_wait)``. And one run per
    quiet period: an event opened a new run only if the previous one was
    due (by that end) or already reserved when its ingest began.
16. **Batches**: every event of a batched function has a note naming its
    batch's run, and is in exactly that batch (``batch_events``); a batch
    holds at most ``max_size`` events, all joined before the run's first
    reservation committed (whose assignment carries exactly them), and that
    reservation's database time is no earlier than the first event's plus
    ``timeout`` unless the batch was full. An event opened a new batch only
    if the previous one was full, due or reserved when its ingest began.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ironflow.protocol import Debounce, FunctionDef, concurrency_limits

if TYPE_CHECKING:
    from tests.sim.observed import Oracle

# Slack on the database clock's float arithmetic (the engine allows 1 µs).
CLOCK_SLACK_S = 1e-5


def _functions() -> dict[str, FunctionDef]:
    from tests.sim.simulator import FUNCTIONS

    return {fd.id: fd for fd in FUNCTIONS}


def _period_end(d: Debounce, joined: list[tuple[int, int, float, str, str]]) -> float:
    """When a debounced run's quiet period ends, its events (commit order,
    database time third) being ``joined``: ``period`` after the last, at
    most ``max_wait`` after the first."""
    end = joined[-1][2] + d.period_s
    return end if d.max_wait_s is None else min(end, joined[0][2] + d.max_wait_s)


@dataclass
class FlowWatch:
    """What the oracle keeps of flow control while a seed runs."""

    oracle: Oracle
    # run id → (commit number, database time) of its first reservation seen.
    first_starts: dict[str, tuple[int, float]] = field(default_factory=dict)
    peaks: Counter[tuple[str, str | None]] = field(default_factory=Counter)
    # debounced run id → (commit number, database time, assignment's event id) of its first reservation.
    debounce_starts: dict[str, tuple[int, float | None, str]] = field(default_factory=dict)
    # batch run id → (commit number, database time, the assignment's events) of its first reservation.
    batch_starts: dict[str, tuple[int, float | None, list[str]]] = field(default_factory=dict)

    def reserved(self, reservations: Sequence[Any], db_now: float | None, committed: int) -> None:
        """A reservation call of one node returned ``reservations``, made in
        the transaction numbered ``committed`` at ``db_now``."""
        if not reservations:
            return
        functions = _functions()
        for r in reservations:
            a = r.assignment
            fd = functions.get(a.function_id)
            if fd is not None and fd.throttle is not None and a.run_id not in self.first_starts and db_now is not None:
                self.first_starts[a.run_id] = (committed, db_now)
            if fd is not None and fd.debounce is not None and a.run_id not in self.debounce_starts:
                self.debounce_starts[a.run_id] = (committed, db_now, a.event.id)
            if fd is not None and fd.batch is not None and a.run_id not in self.batch_starts:
                self.batch_starts[a.run_id] = (committed, db_now, [e.id for e in a.events or [a.event]])
        if any(concurrency_limits(functions[r.assignment.function_id]) for r in reservations
               if r.assignment.function_id in functions):
            self.check_concurrency(functions)

    def check_concurrency(self, functions: dict[str, FunctionDef]) -> None:
        """10: every limit holds in the database's current state."""
        o = self.oracle
        held: Counter[tuple[str, str | None]] = Counter()
        for function_id, key, n in o.all(
            "SELECT function_id, concurrency_key, count(*) FROM ("
            " SELECT function_id, concurrency_key FROM concurrency_leases UNION ALL"
            " SELECT function_id, concurrency_key FROM dispatch_queue WHERE reservation_owner IS NOT NULL"
            ") u GROUP BY function_id, concurrency_key"
        ):
            fd = functions.get(function_id)
            for c in concurrency_limits(fd) if fd is not None else []:
                held[(function_id, key if c.key is not None else None)] += int(n)
        o.counts["limit_checks"] += 1
        for (function_id, key), n in sorted(held.items(), key=str):
            self.peaks[(function_id, key)] = max(self.peaks[(function_id, key)], n)
            for c in concurrency_limits(functions[function_id]):
                if (c.key is None) == (key is None) and n > c.limit:
                    what = "in all" if key is None else f"of key {key!r}"
                    o.violation(
                        f"concurrency limit of {function_id} {what} exceeded: {n} leases and"
                        f" reservations held at once, limit {c.limit}"
                    )
                if c.key is not None and key is not None and n == c.limit:
                    o.counts["limit_full"] += 1

    def ingested(self, result: Any) -> None:
        """12: after an ingest (the only call that creates runs), no singleton
        function has two runs in flight; a skip named a run in flight (judged
        only without concurrent nodes: on PostgreSQL that run may have ended
        since the ingest's commit)."""
        o = self.oracle
        functions = _functions()
        singles = sorted(fid for fid, fd in functions.items() if fd.singleton is not None)
        for function_id in singles:
            row = o.one(
                "SELECT count(*) FROM runs WHERE function_id = ?"
                " AND status NOT IN ('completed', 'failed', 'cancelled')",
                (function_id,),
            )
            if row is not None and int(row[0]) > 1:
                o.violation(f"singleton {function_id} has {row[0]} runs in flight")
        for note in result.flow:
            if note.mechanism != "singleton" or note.outcome != "skipped":
                continue
            o.counts["singleton_skips"] += 1
            if o.concurrent:
                continue
            row = o.one("SELECT status FROM runs WHERE id = ?", (note.run_id,))
            if row is None or row[0] in ("completed", "failed", "cancelled"):
                o.violation(
                    f"event {result.event_id} skipped by singleton {note.function_id} for run"
                    f" {note.run_id}, which is not in flight ({row[0] if row else 'no such run'})"
                )

    def check_rate_limits(self) -> None:
        """14: each rate-limited function's events against its GCRA."""
        o = self.oracle
        from tests.sim.simulator import TRIGGERED

        for function_id, fd in sorted(_functions().items()):
            limit = fd.rate_limit
            if limit is None:
                continue
            assert limit.key is None  # keyed limits: key the replay too
            names = sorted(name for name, fids in TRIGGERED.items() if function_id in fids)
            events = o.all(
                f"SELECT e.id, e.received_at, e.flow, EXISTS (SELECT 1 FROM runs r WHERE r.event_id = e.id"
                f" AND r.function_id = ?) FROM events e WHERE e.name IN ({', '.join('?' * len(names))})",
                (function_id, *names),
            )
            seen = sorted(
                (o.ingests[event_id][1], float(at), event_id, bool(started), flow)
                for event_id, at, flow, started in events if event_id in o.ingests
            )
            exact = not o.concurrent and len(seen) == len(events)
            interval = limit.period_s / limit.limit
            tau = limit.period_s - interval  # `limit` events may pass at once
            tat = -math.inf
            for _, at, event_id, started, flow in seen:
                conforms = at >= tat - tau - CLOCK_SLACK_S
                what = f"rate limit of {function_id} ({limit.limit} per {limit.period_s:g}s)"
                if started:
                    o.counts["rate_limited_starts"] += 1
                    if not conforms:
                        o.violation(
                            f"{what} broken: event {event_id} started a run {tat - tau - at:.3f} s"
                            " before it conformed"
                        )
                    tat = max(tat, at) + interval
                    continue
                o.counts["rate_limited_skips"] += 1
                notes = [n for n in json.loads(flow or "[]") if n["function_id"] == function_id]
                if not any(n["mechanism"] == "rate_limit" and n["outcome"] == "skipped"
                           and n["reason"].startswith("rate limit:") for n in notes):
                    o.violation(f"event {event_id} started no run of {function_id}; its flow notes: {notes}")
                if exact and at >= tat - tau + CLOCK_SLACK_S:
                    o.violation(
                        f"{what}: event {event_id} skipped, though it conformed"
                        f" ({at - (tat - tau):.3f} s after it could pass)"
                    )

    def check_debounces(self) -> None:
        """15: each debounced function's events and runs."""
        o = self.oracle
        from tests.sim.simulator import TRIGGERED

        for function_id, fd in sorted(_functions().items()):
            d = fd.debounce
            if d is None:
                continue
            assert d.key is None  # keyed debounces: group by key too
            names = sorted(name for name, fids in TRIGGERED.items() if function_id in fids)
            events = o.all(
                f"SELECT id, received_at, flow FROM events WHERE name IN ({', '.join('?' * len(names))})",
                tuple(names),
            )
            exact = all(event_id in o.ingests for event_id, _, _ in events)
            # (ingest committed, ingest begun, database time, event id, run it names): sorted, commit order.
            seen: list[tuple[int, int, float, str, str]] = []
            for event_id, at, flow in events:
                notes = [n for n in json.loads(flow or "[]")
                         if n["function_id"] == function_id and n["mechanism"] == "debounce"
                         and n["outcome"] == "debounced" and n.get("run_id")]
                if not notes:
                    o.violation(f"event {event_id} has no debounce note for {function_id}")
                elif event_id in o.ingests:
                    begun, committed = o.ingests[event_id]
                    seen.append((committed, begun, float(at), event_id, notes[0]["run_id"]))
            seen.sort()
            period: dict[str, list[tuple[int, int, float, str, str]]] = {}
            for e in seen:
                period.setdefault(e[4], []).append(e)
            run_rows = {
                run_id: (event_id, status)
                for run_id, event_id, status in o.all(
                    "SELECT id, event_id, status FROM runs WHERE function_id = ?", (function_id,)
                )
            }

            for run_id, joined in period.items():
                o.counts["debounced_runs"] += 1
                o.counts["debounced_events"] += len(joined)
                started = self.debounce_starts.get(run_id)
                last = joined[-1][3]
                if exact and run_rows.get(run_id, (None,))[0] != last:
                    o.violation(
                        f"debounced run {run_id} of {function_id} carries event"
                        f" {run_rows.get(run_id, (None,))[0]}, not its period's last, {last}"
                    )
                if started is None:
                    continue
                reserved, at, assigned = started
                late = [e[3] for e in joined if e[1] > reserved]  # began after it committed
                if late:
                    o.violation(f"events {late} joined debounced run {run_id} after its reservation committed")
                elif exact and assigned != last:
                    o.violation(f"debounced run {run_id} was assigned with event {assigned}, not {last}")
                if at is not None and at < _period_end(d, joined) - CLOCK_SLACK_S:
                    o.violation(
                        f"debounced run {run_id} of {function_id} reserved {_period_end(d, joined) - at:.3f} s"
                        " before its quiet period ended"
                    )
            for before, after in zip(seen, seen[1:], strict=False):
                if before[4] == after[4]:
                    continue
                prior = period[before[4]]
                upto = prior[: prior.index(before) + 1]
                started = self.debounce_starts.get(before[4])
                if started is None:
                    continue  # cancelled before any reservation (or one not seen): its period ended
                taken = started[0] < after[1]  # reserved before the next event's ingest began
                if not taken and after[2] < _period_end(d, upto) - CLOCK_SLACK_S:
                    o.violation(
                        f"event {after[3]} opened debounced run {after[4]} of {function_id}"
                        f" {_period_end(d, upto) - after[2]:.3f} s before the quiet period of run {before[4]} ended"
                    )

    def check_batches(self) -> None:
        """16: each batched function's events and batches."""
        o = self.oracle
        from tests.sim.simulator import TRIGGERED

        for function_id, fd in sorted(_functions().items()):
            b = fd.batch
            if b is None:
                continue
            assert b.key is None  # keyed batches: group by key too
            names = sorted(name for name, fids in TRIGGERED.items() if function_id in fids)
            events = o.all(
                f"SELECT id, received_at, flow FROM events WHERE name IN ({', '.join('?' * len(names))})",
                tuple(names),
            )
            members: dict[str, list[str]] = {}  # batch run → its events, by position
            where: dict[str, list[str]] = {}  # event → the batch runs holding it
            for run_id, event_id in o.all(
                "SELECT b.run_id, b.event_id FROM batch_events b JOIN runs r ON r.id = b.run_id"
                " WHERE r.function_id = ? ORDER BY b.run_id, b.position",
                (function_id,),
            ):
                members.setdefault(run_id, []).append(event_id)
                where.setdefault(event_id, []).append(run_id)
            # (ingest committed, ingest begun, database time, event id, its batch's run): commit order.
            seen: list[tuple[int, int, float, str, str]] = []
            for event_id, at, flow in events:
                notes = [n for n in json.loads(flow or "[]")
                         if n["function_id"] == function_id and n["mechanism"] == "batch"
                         and n["outcome"] == "batched" and n.get("run_id")]
                if not notes:
                    o.violation(f"event {event_id} has no batch note for {function_id}")
                    continue
                if where.get(event_id) != [notes[0]["run_id"]]:
                    o.violation(
                        f"event {event_id} is in batches {where.get(event_id)} of {function_id},"
                        f" its note says {notes[0]['run_id']}"
                    )
                if event_id in o.ingests:
                    begun, committed = o.ingests[event_id]
                    seen.append((committed, begun, float(at), event_id, notes[0]["run_id"]))
            seen.sort()
            batches: dict[str, list[tuple[int, int, float, str, str]]] = {}
            for e in seen:
                batches.setdefault(e[4], []).append(e)
            for run_id, held in sorted(members.items()):
                o.counts["batch_runs"] += 1
                o.counts["batched_events"] += len(held)
                if len(held) > b.max_size:
                    o.violation(f"batch run {run_id} of {function_id} holds {len(held)} events, max_size {b.max_size}")
                started = self.batch_starts.get(run_id)
                if started is None:
                    continue
                reserved, at, assigned = started
                late = [e[3] for e in batches.get(run_id, []) if e[1] > reserved]  # began after it committed
                if late:
                    o.violation(f"events {late} joined batch run {run_id} after its reservation committed")
                elif assigned != held:
                    o.violation(f"batch run {run_id} was assigned events {assigned}, its batch holds {held}")
                joined = batches.get(run_id)
                if (at is not None and joined and len(assigned) < b.max_size
                        and at < joined[0][2] + b.timeout_s - CLOCK_SLACK_S):
                    o.violation(
                        f"batch run {run_id} of {function_id} reserved {joined[0][2] + b.timeout_s - at:.3f} s"
                        f" before its timeout, with {len(assigned)} of {b.max_size} events"
                    )
            for before, after in zip(seen, seen[1:], strict=False):
                if before[4] == after[4]:
                    continue
                upto = batches[before[4]][: batches[before[4]].index(before) + 1]
                started = self.batch_starts.get(before[4])
                if started is None:
                    continue  # cancelled before any reservation (or one not seen): its batch closed
                taken = started[0] < after[1]  # reserved before the next event's ingest began
                held = members.get(before[4], [])
                size = held.index(before[3]) + 1 if before[3] in held else b.max_size  # when it joined
                if not taken and size < b.max_size and after[2] < upto[0][2] + b.timeout_s - CLOCK_SLACK_S:
                    o.violation(
                        f"event {after[3]} opened batch run {after[4]} of {function_id} while batch"
                        f" {before[4]} held {size} of {b.max_size} events and was not due"
                    )

    def check_throttles(self) -> None:
        """11: the first starts of each throttled function conform to its GCRA."""
        functions = _functions()
        by_function: dict[str, list[tuple[int, float, str]]] = {}
        for run_id, (committed, at) in self.first_starts.items():
            row = self.oracle.one("SELECT function_id FROM runs WHERE id = ?", (run_id,))
            if row is not None:
                by_function.setdefault(row[0], []).append((committed, at, run_id))
        for function_id, starts in sorted(by_function.items()):
            t = functions[function_id].throttle
            assert t is not None and t.key is None  # keyed throttles: key the replay too
            interval = t.period_s / t.limit
            tau = interval * (t.burst - 1)
            tat = 0.0
            for _, at, run_id in sorted(starts):
                if at < tat - tau - CLOCK_SLACK_S:
                    self.oracle.violation(
                        f"throttle of {function_id} ({t.limit} per {t.period_s:g}s, burst {t.burst})"
                        f" broken: run {run_id} started {tat - tau - at:.3f} s before it conformed"
                    )
                if at < tat - CLOCK_SLACK_S:
                    self.oracle.counts["throttle_burst_starts"] += 1
                tat = max(tat, at) + interval
            self.oracle.counts["throttled_starts"] += len(starts)
