"""The one implementation of :class:`~ironflow.store.base.Store`, assembled
from one module per concern so each seed mechanism reads on its own:

- ``tx``: the transaction surface (``Tx``) and the value codecs;
- ``transitions``: the shared transitions every operation calls as functions
  of its ``Tx`` (enqueue, take a segment, end, resume, cancel, recover; the
  audit rows and credits they write);
- ``core``: shared machinery (``SqlStoreBase``: the transaction hook,
  definition decoding, run creation, the fence check);
- ``fence``: the fence and a segment's life (ack, complete/fail/yield,
  nack, heartbeat); ``steps``: a segment's step results, under its fence;
- ``waits``: ``wait_for_event`` parked, looked back, resolved, and its lock order;
- ``capacity_scan``: loop 1, the capacity scanner's expiries and recovery;
- ``wake_claims``: the waker's claims and loop 2, the stale-claim sweeper;
- ``dispatch``: reservations and assignments; ``dispatch_flow``: flow
  control at dispatch (concurrency keys, throttles, priority);
- ``ingest``: events (with a trace's ``traceparent``), runs, invocations, cancellation; ``filters``: trigger
  filters and expression keys; ``flow``: ingest-side flow control;
  ``cancel_on``: cancel on an event; ``compensation``: a cancelled run's undos;
- ``sessions``: worker registration, functions, pull-session ownership;
- ``run_control``: resume and pause a run;
- ``outage``: the probe and the blind time given back after an outage;
- ``cron``: cron ticks claimed and fired, functions paused and resumed;
- ``function_life``: functions live (a worker within ``function_live_s``), deleted, restored;
- ``reads``, ``event_reads`` (events, re-runs), ``gauges`` (for /metrics),
  ``stats`` (the dashboard's counts), ``history`` (retention), ``keys``.

The backends (``sqlite.py``, ``postgres.py`` with ``pg_tx.py``) add
``_transact`` and their lifecycle; ``schema.py`` holds the numbered migrations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import outcome

from ironflow.store.capacity_scan import CapacityLoop
from ironflow.store.core import Tx
from ironflow.store.cron import CronOps
from ironflow.store.dispatch import DispatchOps
from ironflow.store.event_reads import EventReadOps
from ironflow.store.fence import FenceOps, completed_ids, completed_results, distinct_runs
from ironflow.store.flow import FlowOps
from ironflow.store.function_life import FunctionLifeOps
from ironflow.store.gauges import GaugeOps
from ironflow.store.history import RetentionOps
from ironflow.store.ingest import IngestOps
from ironflow.store.keys import KeyOps
from ironflow.store.outage import OutageOps
from ironflow.store.reads import ReadOps
from ironflow.store.records import Fence, IngestResult, JobOutcome, Reservations, StepResult
from ironflow.store.run_control import RunControlOps
from ironflow.store.sessions import SessionOps
from ironflow.store.stats import StatsOps
from ironflow.store.steps import StepResultOps
from ironflow.store.wake_claims import WakeLoop


class SqlStore(
    SessionOps, FenceOps, StepResultOps, IngestOps, FlowOps, DispatchOps, CapacityLoop, WakeLoop, ReadOps, RetentionOps, KeyOps,
    EventReadOps, GaugeOps, StatsOps, OutageOps, CronOps, FunctionLifeOps,
    RunControlOps,  # resume / pause a run
):
    """Every Store method, written once. Backends supply ``_transact`` and lifecycle."""

    async def ingest_and_reserve(
        self,
        events: list[tuple[str, Any, str | None]],
        *,
        idempotency_window_s: float,
        offers: dict[str, frozenset[str]],
        limit: int,
        reservation_expiry_s: float,
    ) -> tuple[list[IngestResult], Reservations]:
        """:meth:`ingest_events`, then — in the same transaction, when the
        events queued a run — one reservation round for ``offers`` (as
        :meth:`reserve_segments` with ``limit``): the queue in dispatch order,
        so a new run is reserved only when no older row of its functions
        comes first. One commit instead of two, and the assignment can leave
        before the emit is answered (docs/design.md, "The emit's reservation")."""
        round_ = self._reservation_round(offers, limit, reservation_expiry_s, joined=True)
        if round_ is None:
            return await self.ingest_events(events, idempotency_window_s=idempotency_window_s), Reservations()
        reserve = round_.work

        def work(tx: Tx) -> tuple[list[IngestResult], Reservations]:
            results = self._ingest_group(tx, events, idempotency_window_s)
            queued = {rid for r in results for rid in (*r.run_ids, *r.resumed_run_ids)}
            if not queued:
                return results, Reservations()
            # The other nodes' dispatchers (and this node's, through its kick
            # listener) need the ingest's kick only for what this round leaves
            # behind: a run not reserved here, or a cancelled run's freed slot.
            kick_others = tx.take_notify()
            made = reserve(tx)
            left = queued - {r.assignment.run_id for r in made}
            if kick_others and (left or any(r.cancelled for r in results)):
                tx.notify()
            return results, made

        out = await self._transact_ingest(
            work, lambda both: both[0], [*self._ingest_locks(events), *round_.locks]
        )
        round_.count_held()
        return out

    async def complete_jobs_and_reserve(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        *,
        offers: dict[str, frozenset[str]],
        limit: int,
        reservation_expiry_s: float,
        activate: frozenset[str] = frozenset(),
        lease_expiry_s: float = 0.0,
    ) -> tuple[list[outcome.Outcome[JobOutcome]], Reservations]:
        """:meth:`complete_jobs`, then — in the same transaction, when one of
        them freed its credit — one reservation round for ``offers``: the
        freed slot's next segment is reserved by the commit that freed it,
        not by a dispatcher round after it (one transaction per segment
        fewer; docs/design.md, "The emit's reservation")."""
        round_ = self._reservation_round(offers, limit, reservation_expiry_s, joined=True)
        if round_ is None or not distinct_runs(items):
            return await self.complete_jobs(items, activate=activate, lease_expiry_s=lease_expiry_s), Reservations()
        complete, reserve = self._completing(items, activate), round_.work

        def work(tx: Tx) -> tuple[list[outcome.Outcome[JobOutcome]], Reservations]:
            results = complete(tx)
            if not any(isinstance(r, outcome.Value) for r in results):
                return results, Reservations()  # no credit freed: nothing new to reserve
            return results, reserve(tx)

        ended = completed_results(items)
        out = await self._transact_ending(
            work, lambda both: completed_ids(both[0]), round_.locks, results=lambda both: ended(both[0])
        )
        round_.count_held()
        return out
