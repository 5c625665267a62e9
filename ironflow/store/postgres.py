"""The production backend: PostgreSQL shared by many nodes, behind a database actor.

psycopg's async API is asyncio-only, so the node talks to PostgreSQL through
sync connections owned by dedicated threads (the *database actor*). Every
store call is a ``work(tx)`` closure queued to those threads. A thread takes
everything pending (at most :data:`MAX_GROUP` calls) and runs it as ONE
transaction with ONE commit (group commit), then hands each result back to
its Trio task with ``run_sync_soon``. A result is delivered only after the
COMMIT returned, and the COMMIT waits for its WAL flush (``synchronous_commit``
on), so an acknowledged call survives a crash of the node or of PostgreSQL —
unless every call of the group was queued with ``synchronous_commit=False``
(see :meth:`PostgresStore._transact`): then the group runs ``SET LOCAL
synchronous_commit TO off``.

One call's failure never undoes another call's work:

* optimistic pass: the group runs without savepoints (they would cost two
  round trips per call). If every call succeeds, it commits.
* if any call raises (a Python exception such as ``StaleExecution``, an SQL
  error, a deadlock), the whole transaction is rolled back — nothing of it was
  committed — and the group is run again in the careful pass, one SAVEPOINT
  per call: a failing call is rolled back to its savepoint and gets its error;
  a deadlock victim or serialization failure is rolled back to its savepoint
  and queued again for the next group (after this one committed and released
  its locks), at most :data:`TX_ATTEMPTS` times in all. Closures are
  therefore run again after such a rollback; they have no effect outside the
  transaction (the store's contract since PostgreSQL's deadlock retry).

``NOTIFY`` is coalesced: calls only record that they want the dispatcher
kick, and the group sends one ``pg_notify`` before its COMMIT (dropped with a
call rolled back to its savepoint).

Cancellation, decided under one lock with the actor taking the request: a
caller cancelled while its request still waits in the queue withdraws it (the
actor skips it) and ``trio.Cancelled`` propagates at once. Once an actor took
the request, it runs to its commit or rollback; the caller waits shielded for
the result (a committed result is never dropped, and no statement is
interrupted, so a connection is never left mid-transaction), returns it, and
the cancellation is delivered at its next checkpoint. A connection that
fails is closed, every call of its group gets the error, and the thread opens
a new one for the next group.

Row locks are held until the group commits (a few milliseconds): other nodes'
transactions touching the same rows wait that long. The claims use ``SKIP
LOCKED``, so they skip rather than wait; a deadlock between groups (of this
node's connections or of several nodes) costs PostgreSQL's
``deadlock_timeout`` (1 s by default) to the victim call only, which is
retried.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import msgspec
import outcome
import psycopg
import trio
from psycopg import pq

from ironflow import logs
from ironflow.config import Timings
from ironflow.store import chain
from ironflow.store.availability import ANSWER_WHEN_DOWN, Availability, settle, translated
from ironflow.store.base import (
    CommitOutcomeUnknown,
    StoreUnavailable,
)
from ironflow.store.cancel_on import CANCEL_CHANNEL, notices_decode
from ironflow.store.chain import chained
from ironflow.store.core import NamedLock, Tx
from ironflow.store.handback import hand_back
from ironflow.store.pg_connect import connect, refuse_read_only, session_bounds, unavailable
from ironflow.store.pg_tx import PREPARED_MAX, PgTx, fast_path_refusal, in_transaction
from ironflow.store.schema import SCHEMA_LOCK_KEY, migrate
from ironflow.store.sql import SqlStore

__all__ = ["PostgresStore"]

log = logging.getLogger("ironflow.store")
# How long close() waits for an actor's thread once the node stopped while the
# database was silent (abandon_calls): a thread on a dead connection is left
# to the TCP bounds, the node does not wait for them.
ABANDONED_CLOSE_S = 1.0
T = TypeVar("T")

# A call PostgreSQL aborted as a deadlock victim (or serialization failure) is
# run this many times in all, each retry in a later group than the last.
TX_ATTEMPTS = 5
# A schema upgrade PostgreSQL picked as a deadlock's victim (beside running
# nodes of the old version) is tried this many times in all, SCHEMA_RETRY_S
# longer apart each time.
SCHEMA_ATTEMPTS = 5
SCHEMA_RETRY_S = 0.2
# Most calls one group commit takes: bounds the latency of the first call in
# a burst while still amortising the commit (one WAL flush) over many.
MAX_GROUP = 128
# Connections (each its own actor thread) per node. One is on duty and takes
# every call; the other relieves it only while its group is stuck (see
# RELIEF_AFTER_S), so one slow group never stops the node's store.
ACTOR_CONNECTIONS = 2
# How long the actor on duty may spend in one group before another actor
# takes calls beside it: past what a loaded group takes (6-10 ms with fsync
# on, docs/benchmarks.md), short of what a caller would notice. Below it,
# calls wait for the group on duty and join the next one: two actors taking
# calls in turn made twice as many, half-size groups, each paying its commit.
RELIEF_AFTER_S = 0.05
# LISTEN/NOTIFY channel that carries dispatcher kicks between nodes.
KICK_CHANNEL = "ironflow_kick"
# LISTEN/NOTIFY channel that carries the ids of ended runs (comma-separated),
# so a result wait on one node wakes when another node ends the run.
RUN_END_CHANNEL = "ironflow_run_end"
# Most payload bytes per NOTIFY (PostgreSQL refuses 8,000 and more).
NOTIFY_PAYLOAD_MAX = 7900
# How often the listener thread looks up from its socket to see if it must stop.
LISTEN_POLL_S = 0.5
# How often start-up checks that the listener thread is listening.
LISTEN_READY_POLL_S = 0.01

# Errors after which PostgreSQL rolled back the statement for a reason that
# running the same call again (after the other transaction ended) resolves.
_RETRYABLE = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

_PENDING, _TAKEN, _WITHDRAWN = 0, 1, 2

class _Request:
    """One queued store call: its closure and how to hand back its outcome."""

    __slots__ = (
        "attempts", "chain", "deliver", "locks", "state", "synchronous_commit", "token", "work",
    )

    def __init__(
        self,
        work: Callable[[Tx], Any],
        token: trio.lowlevel.TrioToken,
        deliver: Callable[[outcome.Outcome[Any]], None],
        chain: object | None = None,
        locks: Sequence[NamedLock] = (),
        synchronous_commit: bool = True,
    ) -> None:
        self.work = work
        self.locks = locks
        # False: this call's commit need not wait for its WAL flush (PgTx.begin).
        self.synchronous_commit = synchronous_commit
        self.token = token
        self.deliver = deliver
        self.state = _PENDING
        self.attempts = 0
        # Requests of one chain (``_transact_many``) share this: taken together,
        # run in order, and a retried one takes the rest of its chain with it.
        self.chain = chain

    def hand_back(self, result: outcome.Outcome[Any]) -> None:
        try:
            self.token.run_sync_soon(self.deliver, result)
        except trio.RunFinishedError:
            pass  # the caller's Trio run is over: nobody is waiting


class _Duty:
    """Which of a store's actors takes calls: the one on duty, while it has
    any; another only to relieve a group that has run ``RELIEF_AFTER_S``
    (a lock wait on another node's transaction, a slow WAL flush, a long
    purge), one group at a time for as long as that lasts."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._held = False
        # When the group on duty began; None while the actor on duty waits for calls.
        self._since: float | None = None

    def enter(self) -> bool:
        """Block until the calling actor may take calls: True on duty (until
        :meth:`leave`), False to relieve a group on duty that is stuck."""
        with self._changed:
            while True:
                if not self._held:
                    self._held = True
                    return True
                if self._since is None:
                    self._changed.wait()
                    continue
                left = self._since + RELIEF_AFTER_S - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    def began(self) -> None:
        """The actor on duty begins a group."""
        with self._changed:
            idle, self._since = self._since is None, time.monotonic()
            if idle:
                self._changed.notify()  # a waiter with no deadline gets one

    def waiting(self) -> None:
        """The actor on duty waits for calls (nothing of its is stuck)."""
        with self._changed:
            self._since = None

    def leave(self) -> None:
        with self._changed:
            self._held = False
            self._since = None
            self._changed.notify()


class _Actor:
    """One thread owning one connection: takes groups of requests, commits each once."""

    def __init__(self, store: PostgresStore, name: str) -> None:
        self._store = store
        self._conn: psycopg.Connection[Any] | None = None
        # The store's connection-loss count when this connection was opened: a
        # loss seen by another actor means this one is probably dead too.
        self._losses = 0
        self._prepared: dict[Any, bytes] = {}
        self._pid = 0  # the backend pid of ``_conn``
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _connect(self) -> psycopg.Connection[Any]:
        self._losses = self._store.connection_losses
        conn = connect(self._store.url, self._store.timings)
        conn.prepared_max = PREPARED_MAX
        # A prepared statement's plan made once, for any values: PostgreSQL's
        # default plans the first five executions of each with their values
        # (``auto``), and a group's statements have one text per row count
        # (its VALUES rows, its IN list), so most executions were planned
        # anew. Statements whose plan may depend on a value are never
        # prepared (``_VALUE_PLANNED``). With it, in the same round trip, the
        # server-side bounds of every wait (pg_connect.session_bounds).
        conn.execute(f"SET plan_cache_mode = force_generic_plan; {self._store.session_bounds}")
        self._prepared = {}  # statements are prepared per connection
        self._pid = conn.info.backend_pid
        self._store.own_backends.add(self._pid)
        return conn

    def _close(self, conn: psycopg.Connection[Any]) -> None:
        self._store.own_backends.discard(self._pid)
        conn.close()

    def _loop(self) -> None:
        retry: list[_Request] = []
        duty = self._store._duty
        on_duty = False
        try:
            stop = False
            while not stop:
                if not on_duty and not retry:
                    self._end_begun()  # no transaction left open while waiting
                    on_duty = duty.enter()
                batch, stop = self._store._take(block=False, room=MAX_GROUP - len(retry))
                if not batch and not stop and not retry:
                    self._end_begun()  # nothing to do: no transaction left open while waiting
                    if on_duty:
                        duty.waiting()
                    batch, stop = self._store._take(block=True, room=MAX_GROUP)
                if on_duty:
                    duty.began()
                batch = retry + batch
                retry = self._run_group(batch) if batch else []
            for req in retry:
                req.hand_back(outcome.Error(RuntimeError("PostgresStore closed")))
        finally:
            if on_duty:
                duty.leave()  # another actor takes its own stop sentinel
            if self._conn is not None:
                self._close(self._conn)

    def _run_group(self, batch: list[_Request]) -> list[_Request]:
        """Commit ``batch`` as one transaction; deliver outcomes; return calls to retry."""
        retry: list[_Request] = []
        try:
            if self._conn is not None and self._losses != self._store.connection_losses:
                # Another actor lost its connection since this one was opened
                # (a server restart, a failover): open a fresh one rather than
                # fail a group on a connection the server already dropped.
                self._discard_connection(lost=False)
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            tx = self._store.tx_class(self._conn, self._prepared)
            results = self._optimistic(tx, batch, self._more_queued)
            if results is None:
                results, retry = self._careful(tx, batch, self._more_queued)
        except BaseException as exc:  # the connection or the COMMIT failed: every caller hears it
            self._discard_connection()
            results = [outcome.Error(exc) for _ in batch]  # one each: an outcome unwraps once
            retry = []
        hand_back((req.token, req.deliver, result) for req, result in zip(batch, results, strict=True)
                  if result is not None)
        return retry

    def _end_begun(self) -> None:
        """Roll back the transaction the last group's COMMIT began (see
        ``_commit``) when no group came to use it."""
        conn = self._conn
        if conn is None or not in_transaction(conn.pgconn):
            return
        try:
            conn.pgconn.exec_(b"ROLLBACK")
        except Exception:
            pass
        if conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            self._discard_connection()  # broken: the next group opens a fresh one

    def _discard_connection(self, *, lost: bool = True) -> None:
        if lost and self._conn is not None:
            self._store.connection_losses += 1  # one writer at a time matters little: a hint
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                self._close(conn)
            except Exception:
                pass  # already broken; a fresh one is opened for the next group

    def _more_queued(self) -> bool:
        """Whether a call is waiting for a group (this actor's next, likely)."""
        return not self._store._requests.empty()

    @staticmethod
    def _optimistic(
        tx: PgTx, batch: list[_Request], more_queued: Callable[[], bool]
    ) -> list[outcome.Outcome[Any] | None] | None:
        """Every call in one transaction, no savepoints; ``None`` (rolled back) if one failed."""
        values: list[outcome.Outcome[Any] | None] = []
        notify = False
        ended: list[str] = []
        tx.begin(batch)
        for req in batch:
            tx.notify_wanted = False
            tx.ended = []
            try:
                values.append(outcome.Value(req.work(tx)))
            except Exception:
                tx.raw("ROLLBACK")
                return None
            notify = notify or tx.notify_wanted
            ended += tx.ended
        _commit(tx, batch, notify, ended, then_begin=more_queued())
        return values

    @staticmethod
    def _careful(
        tx: PgTx, batch: list[_Request], more_queued: Callable[[], bool]
    ) -> tuple[list[outcome.Outcome[Any] | None], list[_Request]]:
        """Every call under its own SAVEPOINT: a failure undoes only its own call."""
        results: list[outcome.Outcome[Any] | None] = []
        retry: list[_Request] = []
        notify = False
        ended: list[str] = []
        tx.begin(batch)
        deferred: set[int] = set()  # chains with a request put off to a later group
        for req in batch:
            if req.chain is not None and id(req.chain) in deferred:
                retry.append(req)  # after its chain's earlier request, never before
                results.append(None)
                continue
            tx.notify_wanted = False
            tx.ended = []
            req.attempts += 1
            tx.raw("SAVEPOINT call")
            try:
                value = req.work(tx)
            except _RETRYABLE as exc:
                tx.raw("ROLLBACK TO SAVEPOINT call")
                if req.attempts < TX_ATTEMPTS:
                    retry.append(req)
                    results.append(None)
                    if req.chain is not None:
                        deferred.add(id(req.chain))
                else:
                    results.append(outcome.Error(exc))
            except Exception as exc:
                tx.raw("ROLLBACK TO SAVEPOINT call")
                results.append(outcome.Error(exc))
            else:
                results.append(outcome.Value(value))
                notify = notify or tx.notify_wanted
                ended += tx.ended
            tx.raw("RELEASE SAVEPOINT call")
        _commit(tx, batch, notify, ended, then_begin=more_queued())
        return results, retry


def _commit(tx: PgTx, batch: Sequence[_Request], notify: bool, ended: list[str], *, then_begin: bool) -> None:
    """The group's NOTIFYs and its COMMIT, in one round trip (one simple
    query of several statements: a NOTIFY that fails leaves the COMMIT unrun
    and the group rolled back, as when each was its own round trip).

    A group all of whose calls were queued with ``synchronous_commit=False``
    turns it off for this transaction only (``SET LOCAL`` in the same round
    trip: the setting is read at COMMIT); one call that did not say so keeps
    the whole group waiting for its flush.

    ``then_begin`` (calls are queued for a next group): the next transaction
    begins in the same round trip, so the next group's ``begin`` costs none
    unless it takes named locks. An open transaction that has run no
    statement holds no snapshot and no lock (READ COMMITTED takes a snapshot
    per statement); its ``now()``, the database clock ``ironflow_now()``
    reads, is this COMMIT's moment, earlier than the next group's start by
    the time the actor takes to pick that group up. An actor that finds
    nothing to take rolls it back before it waits (``_Actor._loop``)."""
    statements = [] if any(req.synchronous_commit for req in batch) else ["SET LOCAL synchronous_commit TO off"]
    # The kick: delivered at COMMIT to every node's kick listener, one per group.
    if notify:
        statements.append(f"SELECT pg_notify({_literal(KICK_CHANNEL)}, '')")
    statements += [
        f"SELECT pg_notify({_literal(RUN_END_CHANNEL)}, {_literal(payload)})" for payload in _id_payloads(ended)
    ]
    statements.append("COMMIT")
    if then_begin:
        statements.append("BEGIN")
    try:
        tx.commit(statements)
    except psycopg.OperationalError as exc:
        # The connection broke during COMMIT: the server may have committed.
        raise CommitOutcomeUnknown(f"the database connection failed while committing: {exc}") from exc


def _literal(text: str) -> str:
    """``text`` as an SQL string literal (standard_conforming_strings, on since
    PostgreSQL 9.1: only a quote is escaped)."""
    return "'" + text.replace("'", "''") + "'"


def _id_payloads(run_ids: list[str]) -> list[str]:
    """``run_ids`` comma-joined into as few NOTIFY payloads as the size limit allows."""
    payloads: list[str] = []
    current: list[str] = []
    size = 0
    for run_id in run_ids:
        if current and size + len(run_id) + 1 > NOTIFY_PAYLOAD_MAX:
            payloads.append(",".join(current))
            current, size = [], 0
        current.append(run_id)
        size += len(run_id) + 1
    if current:
        payloads.append(",".join(current))
    return payloads


class PostgresStore(SqlStore):
    """Engine state in PostgreSQL at ``url`` (``postgresql://…``).

    ``connections``: how many actor threads (each owning one connection)
    group-commit this node's store calls.
    """

    shared_by_nodes = True
    group_acks = True
    # Cancel-on: the jobs an event took from workers reach every node by NOTIFY.
    _notifies_cancels = True
    # What the actors run each group's statements through (a test subclass
    # may pause between statements: tests/sim/pg.py).
    tx_class: type[PgTx] = PgTx

    def __init__(
        self, url: str, *, connections: int = ACTOR_CONNECTIONS, timings: Timings | None = None
    ) -> None:
        super().__init__()
        self.url = url.replace("postgres://", "postgresql://", 1)
        self._connections = connections
        # The bounds of every connection's waits (config: timings.pg_*).
        self.timings = timings or Timings()
        self.session_bounds = session_bounds(self.timings)
        self._requests: queue.SimpleQueue[_Request | list[_Request] | None] = queue.SimpleQueue()
        # Taking a request (actor) and withdrawing it (cancelled caller) are decided under it.
        self._state_lock = threading.Lock()
        self._actors: list[_Actor] = []
        # The store monitor's own connection for its direct read probes
        # (:meth:`_direct_read_probe`), idle between them; taken by the probe
        # that uses it, so an abandoned probe's thread keeps it to itself.
        self._monitor_conn: psycopg.Connection[Any] | None = None
        self._monitor_lock = threading.Lock()
        self._duty = _Duty()
        self.availability = Availability()
        self.availability.on_down = self._answer_held
        # Set by abandon_calls(): no call waits for the database any more.
        self._abandoning = False
        # Every call's requests not answered yet (Trio thread only): what
        # abandon_calls() answers.
        self._outstanding: set[_Request] = set()
        # Calls of ANSWER_WHEN_DOWN tasks not yet answered (Trio thread only).
        self._held: set[_Request] = set()
        # Connections the actors lost (see _Actor._run_group).
        self.connection_losses = 0
        # Backend pids of the actors' open connections: a run-end NOTIFY one of
        # them sent is this node's own, announced here after its commit (with
        # the results: Store.on_run_results), not again when it comes back.
        self.own_backends: set[int] = set()

    # lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        if self._actors:
            return
        try:
            await trio.to_thread.run_sync(self._create_schema)
        except psycopg.Error as exc:
            gone = unavailable(exc)
            if gone is None:
                raise
            raise gone from exc
        refused = fast_path_refusal()
        if refused is not None and not self.tx_class.libpq_fast_path:
            logs.event(
                log, logging.WARNING,
                "PostgreSQL store: libpq fast path off, statements go through psycopg's cursor",
                reason=refused,
            )
        self._actors = [
            _Actor(self, f"ironflow-pg-actor-{i}") for i in range(max(1, self._connections))
        ]
        for actor in self._actors:
            actor.thread.start()

    def _create_schema(self) -> None:
        """Apply the migrations the database lacks (``ironflow/store/schema.py``).

        Applying one takes table locks one statement after another (CREATE
        INDEX, ALTER TABLE) in one transaction; beside running nodes, whose
        transactions hold some of those tables and wait for others, that can
        deadlock. A restart of the same version therefore reads the applied
        versions and locks no table; an upgrade applies what is missing,
        retried if PostgreSQL picks it as a deadlock's victim.
        """
        for attempt in range(1, SCHEMA_ATTEMPTS + 1):
            try:
                with connect(self.url) as conn:
                    refuse_read_only(conn, self.url)
                    with conn.transaction(), conn.cursor() as cur:
                        # Two nodes starting together take turns; the second finds nothing to do.
                        cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
                        migrate(cur, "postgres")
                return
            except psycopg.errors.DeadlockDetected:
                if attempt == SCHEMA_ATTEMPTS:
                    raise
                time.sleep(SCHEMA_RETRY_S * attempt)

    def _own_connection(self) -> psycopg.Connection[Any]:
        """A connection of the monitor's, not an actor's: the TCP and session
        bounds of every connection of the node (called in a thread)."""
        conn = connect(self.url, self.timings)
        conn.execute(self.session_bounds)
        return conn

    async def _direct_read_probe(self, work: Callable[[Tx], None]) -> None:
        """``work`` (the read probe) on the monitor's own connection, made on
        first use and after any failure: one round trip that no lock wait or
        backlog of this node's delays, and no connection made per probe (a
        fresh one costs a backend start, slow on a loaded server)."""

        def run() -> None:
            with self._monitor_lock:
                kept, self._monitor_conn = self._monitor_conn, None
            conn = kept or self._own_connection()
            try:
                try:
                    work(PgTx(conn, {}))
                except psycopg.Error:
                    if conn is not kept:
                        raise
                    # The kept connection went stale while idle (a server
                    # restart, a proxy's timeout; the fast path reports it as
                    # a DatabaseError): one fresh try decides.
                    conn.close()
                    conn = self._own_connection()
                    work(PgTx(conn, {}))
            except BaseException:
                conn.close()
                raise
            with self._monitor_lock:
                spare, self._monitor_conn = self._monitor_conn, conn
            if spare is not None:  # made while an abandoned probe held this one
                spare.close()

        # Abandoned on cancel (the monitor's probe timeout): the TCP bounds
        # end the thread, and the connection it holds is its own.
        result = await outcome.acapture(partial(trio.to_thread.run_sync, run, abandon_on_cancel=True))
        settle(self.availability, result, unavailable)

    async def _outage_transact(self, work: Callable[[Tx], T]) -> T:
        """``work`` in one transaction on a fresh connection of its own (not
        queued behind the actors' groups: a recovering node's backlog must not
        delay the probe that ends its outage). A server that only reads counts
        as down: after a failover the URL may reach the old primary come back
        as a standby."""

        def run() -> T:
            with self._own_connection() as conn:
                row = conn.execute(
                    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
                ).fetchone()
                if row is not None and (row[0] or row[1] == "on"):
                    raise StoreUnavailable(
                        "PostgreSQL is read-only (in recovery or default_transaction_read_only)"
                    )
                tx = PgTx(conn, {})
                tx.raw("BEGIN")
                value = work(tx)
                tx.raw("COMMIT")
                return value

        # Abandoned on cancel (the monitor's probe timeout): connect_timeout
        # bounds the thread, and its connection is its own.
        result = await outcome.acapture(partial(trio.to_thread.run_sync, run, abandon_on_cancel=True))
        return settle(self.availability, result, unavailable)

    def _announce_cancel_payload(self, payload: str) -> None:
        """A NOTIFY from :data:`CANCEL_CHANNEL` (the listener below)."""
        try:
            notices = notices_decode(payload)
        except msgspec.DecodeError:
            return  # not ours
        self._announce_cancels(notices)

    def abandon_calls(self) -> None:
        self._abandoning = True
        outstanding, self._outstanding = self._outstanding, set()
        for req in outstanding:
            with self._state_lock:
                never_ran = req.state == _PENDING
                if never_ran:
                    req.state = _WITHDRAWN
            req.deliver(outcome.Error(StoreUnavailable(
                "the node is stopping and the database does not answer: this call was not applied"
                if never_ran else
                "the node is stopping and the database stopped answering while applying this call,"
                " which may or may not have taken effect"
            )))

    async def close(self) -> None:
        with self._monitor_lock:
            monitor, self._monitor_conn = self._monitor_conn, None
        if monitor is not None:
            monitor.close()  # idle: only a probe that answered puts it back
        if not self._actors:
            return
        actors, self._actors = self._actors, []
        for _ in actors:
            self._requests.put(None)

        # An actor stuck on a connection that went silent (a partition) ends
        # at the TCP bound; past it the node stops without it (its thread is a
        # daemon, its transaction the server's to end).
        bound_s = ABANDONED_CLOSE_S if self._abandoning else self.timings.pg_tcp_timeout_s + 1.0

        def join() -> int:
            deadline = time.monotonic() + bound_s
            for actor in actors:
                actor.thread.join(max(0.0, deadline - time.monotonic()))
            return sum(actor.thread.is_alive() for actor in actors)

        with trio.CancelScope(shield=True):
            stuck = await trio.to_thread.run_sync(join)
        if stuck:
            logs.event(
                log, logging.WARNING,
                "store: closed with connections still waiting on the database, left to the TCP bounds",
                connections=stuck, waited_s=f"{bound_s:g}",
            )

    async def reclaim_space(self, max_pages: int) -> int:
        """Nothing to do: autovacuum makes deleted rows' space reusable (it does
        not shrink the files; ``VACUUM FULL`` would, under an exclusive lock)."""
        await trio.lowlevel.checkpoint()
        return 0

    async def watch_kicks(
        self,
        on_kick: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """LISTEN on a dedicated connection; call ``on_kick`` (on the Trio thread)
        for every kick until cancelled, and tell this store's run-end listeners
        about runs other nodes ended (a result wait here wakes at once). A lost
        connection raises."""
        stop = threading.Event()
        listening = threading.Event()
        token = trio.lowlevel.current_trio_token()

        def listen() -> None:
            with connect(self.url, self.timings) as conn:  # TCP bounds: it idles, silent
                conn.execute(f"LISTEN {KICK_CHANNEL}")
                conn.execute(f"LISTEN {RUN_END_CHANNEL}")
                conn.execute(f"LISTEN {CANCEL_CHANNEL}")
                listening.set()
                while not stop.is_set():
                    for note in conn.notifies(timeout=LISTEN_POLL_S, stop_after=1):
                        if note.channel == RUN_END_CHANNEL:
                            if note.pid not in self.own_backends:  # another node's
                                token.run_sync_soon(self._announce_ended, note.payload.split(","))
                        elif note.channel == CANCEL_CHANNEL:
                            token.run_sync_soon(self._announce_cancel_payload, note.payload)
                        else:
                            token.run_sync_soon(on_kick)

        async with trio.open_nursery() as nursery:

            async def listener() -> None:
                with trio.CancelScope(shield=True):
                    result = await outcome.acapture(trio.to_thread.run_sync, listen)
                if isinstance(result, outcome.Error):
                    # Raised as an outage (the supervisor waits rather than
                    # counting a crash) but not marked as one: this one long
                    # connection can die alone; the store monitor judges.
                    gone = unavailable(result.error)
                    if gone is not None:
                        raise gone from result.error
                result.unwrap()

            nursery.start_soon(listener)
            # The thread only ends once told to: tell it on every way out,
            # including a cancel that arrives before it is listening.
            try:
                while not listening.is_set():
                    await trio.sleep(LISTEN_READY_POLL_S)
                task_status.started()
                await trio.sleep_forever()
            finally:
                stop.set()

    # the database actor -----------------------------------------------------------

    def _take(self, *, block: bool, room: int) -> tuple[list[_Request], bool]:
        """Up to ``room`` pending requests, marked taken (withdrawn ones skipped),
        waiting for the first one if ``block``; and whether this actor must stop
        after them (it took a stop sentinel: one per actor, queued by close())."""
        batch: list[_Request] = []
        while len(batch) < room:
            try:
                req = self._requests.get(block=block and not batch)
            except queue.Empty:
                break
            if req is None:
                return batch, True
            if isinstance(req, list):  # a chain: all of it, in order
                with self._state_lock:
                    if any(member.state != _PENDING for member in req):
                        continue  # withdrawn (all of it) by _answer_held
                    for member in req:
                        member.state = _TAKEN
                batch += req
                continue
            with self._state_lock:
                if req.state != _PENDING:
                    continue  # withdrawn by its cancelled caller
                req.state = _TAKEN
            batch.append(req)
        return batch, False

    async def in_order(
        self, calls: Sequence[Callable[[], Awaitable[Any]]]
    ) -> list[outcome.Outcome[Any]]:
        """The calls' first transactions chained into one group (see
        ``ironflow/store/chain.py``), one commit instead of one each. Not on
        SQLite, whose commits are in-process: there the chain's Trio
        bookkeeping cost more than it saved (measured with scripts/bench.py)."""
        if len(calls) == 1:
            return await super().in_order(calls)
        return await chain.in_order(calls, self._transact_many)

    async def _transact_many(
        self, works: list[tuple[Callable[[Tx], Any], Sequence[NamedLock]]]
    ) -> list[outcome.Outcome[Any]]:
        """``works`` as consecutive requests of one group, in order, each its own
        unit of work (see ``_Actor._careful`` for a retried one); their outcomes."""
        self.availability.check()
        if self._abandoning:
            raise StoreUnavailable("the node is stopping and the database does not answer")
        if not self._actors:
            raise RuntimeError("PostgresStore is not open")
        done = trio.Event()
        box: dict[int, outcome.Outcome[Any]] = {}

        def deliver_at(place: int) -> Callable[[outcome.Outcome[Any]], None]:
            def deliver(result: outcome.Outcome[Any]) -> None:
                box[place] = result
                if len(box) == len(works):
                    done.set()

            return deliver

        token = trio.lowlevel.current_trio_token()
        chain = object()
        members = [_Request(work, token, deliver_at(i), chain, locks) for i, (work, locks) in enumerate(works)]
        held = ANSWER_WHEN_DOWN.get()
        if held:
            self._held.update(members)
        # One queue item: one actor takes the whole chain into one group, in order.
        self._requests.put(members)
        self._outstanding.update(members)
        try:
            with trio.CancelScope(shield=not held):
                await done.wait()
        finally:
            self._outstanding.difference_update(members)
            if held:
                self._held.difference_update(members)
        return translated(self.availability, [box[i] for i in range(len(works))], unavailable)

    async def _transact(
        self,
        work: Callable[[Tx], T],
        locks: Sequence[NamedLock] = (),
        *,
        synchronous_commit: bool = True,
    ) -> T:
        """``work`` queued to the database actor; its result once its group
        committed. ``synchronous_commit=False``: see ``SqlStoreBase._transact``
        (a chained call — ``in_order`` — always waits for its flush)."""
        self.availability.check()
        if self._abandoning:
            raise StoreUnavailable("the node is stopping and the database does not answer")
        pending = chained(work, locks)
        if pending is not None:
            return await pending
        if not self._actors:
            raise RuntimeError("PostgresStore is not open")
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        req = _Request(
            work, trio.lowlevel.current_trio_token(), deliver, locks=locks,
            synchronous_commit=synchronous_commit,
        )
        held = ANSWER_WHEN_DOWN.get()
        if held:
            self._held.add(req)
        self._outstanding.add(req)
        self._requests.put(req)
        try:
            await done.wait()
        except trio.Cancelled:
            with self._state_lock:
                withdrawn = req.state == _PENDING
                if withdrawn:
                    req.state = _WITHDRAWN
            if withdrawn or held:
                raise  # never ran (nothing to hand back), or given up on (ANSWER_WHEN_DOWN)
            # An actor is running it: it will commit or roll back; its result
            # must reach the caller (the cancellation comes at the next
            # checkpoint), unless the node stops while the database is silent.
            with trio.CancelScope(shield=True):
                await done.wait()
        finally:
            self._outstanding.discard(req)
            if held:
                self._held.discard(req)
        return settle(self.availability, box[0], unavailable)

    def _answer_held(self) -> None:
        """The store was marked down: every ANSWER_WHEN_DOWN call still waiting
        gets StoreUnavailable now, instead of when its connection answers (a
        silent one may not for the TCP timeout). A call no actor took yet is
        withdrawn (it never runs); one an actor took may still commit, and its
        message says so. Every connection opened before the outage is suspect
        (a partition the kernel has not noticed yet): each actor opens a fresh
        one for its next group, so the first calls after the outage do not
        meet a dead one."""
        self.connection_losses += 1
        held, self._held = self._held, set()
        cause = self.availability.cause
        for req in held:
            with self._state_lock:
                never_ran = req.state == _PENDING
                if never_ran:
                    req.state = _WITHDRAWN
            message = (
                f"{cause}; this request was not applied: retry" if never_ran else
                f"{cause}; the database stopped answering while applying this request,"
                " which may or may not have taken effect: retry with an idempotency key"
            )
            req.deliver(outcome.Error(StoreUnavailable(message)))
