"""What every handler needs from the node, reached through the running app."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import outcome
import trio
from quart import current_app

from actors.directory import SessionDirectory
from actors.grouped import Grouped
from actors.handout import BATCH, hand_out_or_expire
from actors.messages import Kick, kick
from actors.session import RunStateBudget
from ironflow.config import NodeConfig
from ironflow.protocol import RunResult
from ironflow.store import (
    IngestResult,
    Principal,
    Reservation,
    SessionInfo,
    Store,
    StoreUnavailable,
)

if TYPE_CHECKING:
    from ironflow.api.chaos import CrashableActors

log = logging.getLogger("ironflow.api")

# Key of the ApiState in ``app.extensions``.
EXTENSION = "ironflow"


class ApiDeps:
    """Everything the API needs from the node, passed in once."""

    def __init__(
        self,
        *,
        store: Store,
        config: NodeConfig,
        node_id: str,
        directory: SessionDirectory,
        kicks: trio.MemorySendChannel[Kick],
        shutdown_requested: trio.Event,
        ready: trio.Event,
        actors: CrashableActors | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.node_id = node_id
        self.directory = directory
        self.kicks = kicks
        self.shutdown_requested = shutdown_requested
        self.ready = ready
        # The node's supervisor, for the chaos routes (None: they answer 404).
        self.actors = actors


class RunWaiter:
    """One request waiting for a run to end: ``ended`` is set when this node
    ends it; ``result`` is its result when the commit that ended it knew it
    in full (a completion), else None (the waiter reads the run)."""

    __slots__ = ("ended", "result")

    def __init__(self) -> None:
        self.ended = trio.Event()
        self.result: RunResult | None = None


class RunWaiters:
    """Requests waiting for runs to end, woken by the store's run-end announcements."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[RunWaiter]] = {}

    @contextlib.contextmanager
    def watch(self, run_id: str) -> Iterator[RunWaiter]:
        """A waiter for ``run_id``, woken when this node ends it; unregistered on exit."""
        waiter = RunWaiter()
        self._waiters.setdefault(run_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            waiting = self._waiters.get(run_id)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiters[run_id]

    def notify(self, run_ids: list[str]) -> None:
        """These runs ended (:meth:`Store.on_runs_ended`): wake their waiters."""
        for run_id in run_ids:
            for waiter in self._waiters.get(run_id, ()):
                waiter.ended.set()

    def answer(self, results: list[RunResult]) -> None:
        """These runs ended with these results (:meth:`Store.on_run_results`):
        wake their waiters with them."""
        for result in results:
            for waiter in self._waiters.get(result.run_id, ()):
                waiter.result = result
                waiter.ended.set()


class ApiState:
    """The node's dependencies plus the API's own caches (one per app)."""

    def __init__(self, deps: ApiDeps) -> None:
        self.deps = deps
        self.store = deps.store
        self.config = deps.config
        # SHA-256 of an API key → (monotonic expiry, its principal).
        self.auth_cache: dict[str, tuple[float, Principal]] = {}
        # Pull sessions this node has verified: id → (hash of its secret, session).
        self.pull_sessions: dict[str, tuple[str, SessionInfo]] = {}
        # Pull session id → its jobs' run state budget (actors/session.py).
        self.pull_budgets: dict[str, RunStateBudget] = {}
        self.run_waiters = RunWaiters()
        deps.store.on_run_results(self.run_waiters.answer)
        deps.store.on_runs_ended(self.run_waiters.notify)
        # Concurrent emits without an idempotency key, ingested together
        # (Store.ingest_events: two statements per group on PostgreSQL);
        # (name, data, traceparent or None).
        self.emits: Grouped[tuple[str, Any, str | None], IngestResult] = Grouped(self._ingest_group)

    async def _ingest(
        self, events: list[tuple[str, Any, str | None, str | None]]
    ) -> list[IngestResult]:
        """``(name, data, idempotency_key, traceparent)`` ingested in one call;
        the traced ingest only when one of them has a trace."""
        window = self.config.idempotency_window_s
        if any(tp is not None for *_, tp in events):
            return await self.store.ingest_traced_events(events, idempotency_window_s=window)
        return await self.store.ingest_events(
            [(name, data, key) for name, data, key, _ in events], idempotency_window_s=window
        )

    async def _ingest_group(
        self, events: list[tuple[str, Any, str | None]]
    ) -> list[outcome.Outcome[IngestResult]]:
        """Ingest a group of emits. While a local worker can take them, the runs
        they queue are reserved in the same transaction
        (:meth:`Store.ingest_and_reserve`) and handed to it before the emits
        are answered; the dispatcher is kicked for the rest."""
        offers = self.deps.directory.holding_offers()
        reserving_ns = time.time_ns()
        reservations: list[Reservation] = []
        try:
            if offers and all(tp is None for _, _, tp in events):
                results, reservations = await self.store.ingest_and_reserve(
                    [(name, data, None) for name, data, _ in events],
                    idempotency_window_s=self.config.idempotency_window_s,
                    offers=offers,
                    limit=BATCH,
                    reservation_expiry_s=self.config.timings.reservation_expiry_s,
                )
            else:
                results = await self._ingest([(name, data, None, tp) for name, data, tp in events])
        except StoreUnavailable:
            # An outage: one by one would fail again. Or CommitOutcomeUnknown
            # (one): it may have committed, one by one would write each event again.
            raise
        except Exception:
            if len(events) == 1:
                raise
            # One event's failure must not fail the others': each alone.
            return [await outcome.acapture(self._ingest_alone, name, data, tp) for name, data, tp in events]
        # Committed: from here nothing may fail the emits.
        await hand_out_or_expire(self.store, self.deps.directory, reservations, reserving_ns, "emit")
        reserved = {r.assignment.run_id for r in reservations}
        if any(rid not in reserved for r in results for rid in (*r.run_ids, *r.resumed_run_ids)):
            kick(self.deps.kicks, "event ingested")
        return [outcome.Value(result) for result in results]

    async def _ingest_alone(self, name: str, data: Any, traceparent: str | None) -> IngestResult:
        window = self.config.idempotency_window_s
        if traceparent is None:
            result = await self.store.ingest_event(name, data, None, idempotency_window_s=window)
        else:
            [result] = await self.store.ingest_traced_events(
                [(name, data, None, traceparent)], idempotency_window_s=window
            )
        if result.run_ids or result.resumed_run_ids:
            kick(self.deps.kicks, "event ingested")
        return result


def state() -> ApiState:
    """The ApiState of the app handling the current request or websocket."""
    return cast(ApiState, current_app.extensions[EXTENSION])
