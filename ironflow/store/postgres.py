"""The production backend: PostgreSQL shared by many nodes.

psycopg's async API is asyncio-only, so each transaction runs on a pooled
sync connection in a Trio worker thread. The thread call is shielded: a
committed result is never dropped and a thread holding a connection is never
abandoned. If the caller is cancelled meanwhile, the running statement is
interrupted with ``conn.cancel_safe()`` (the transaction rolls back) and the
cancellation propagates once the thread is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import outcome
import psycopg
import trio
from psycopg_pool import ConnectionPool

from ironflow.store.core import Tx
from ironflow.store.schema import (
    SCHEMA_LOCK_KEY,
    added_columns,
    backfill_statements,
    statements,
)
from ironflow.store.sql import SqlStore

__all__ = ["PostgresStore"]

T = TypeVar("T")

_sql_cache: dict[str, str] = {}


def _pg_sql(sql: str) -> str:
    """``?`` placeholders → psycopg's ``%s`` (literal ``%`` escaped), memoised."""
    out = _sql_cache.get(sql)
    if out is None:
        out = _sql_cache[sql] = sql.replace("%", "%%").replace("?", "%s")
    return out



# A transaction PostgreSQL aborted as a deadlock victim (or serialization
# failure) is retried this many times in all, with a short linear backoff.
TX_ATTEMPTS = 5
# LISTEN/NOTIFY channel that carries dispatcher kicks between nodes.
KICK_CHANNEL = "ironflow_kick"
# How often the listener thread looks up from its socket to see if it must stop.
LISTEN_POLL_S = 0.5
# How often start-up checks that the listener thread is listening.
LISTEN_READY_POLL_S = 0.01
TX_RETRY_BACKOFF_S = 0.005

class _PgTx:
    """:class:`~ironflow.store.core.Tx` over one psycopg connection inside a transaction."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._cur = conn.cursor()
        self._notified = False

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        self._cur.execute(_pg_sql(sql), params, prepare=True)
        return self._cur.rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._cur.executemany(_pg_sql(sql), list(rows))

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        self._cur.execute(_pg_sql(sql), params, prepare=True)
        return self._cur.fetchone()

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._cur.execute(_pg_sql(sql), params, prepare=True)
        return self._cur.fetchall()

    def lock(self, of: str | None = None) -> str:
        return f"FOR UPDATE OF {of} SKIP LOCKED" if of else "FOR UPDATE SKIP LOCKED"

    def lock_wait(self) -> str:
        return "FOR UPDATE"

    def share_lock(self, of: str) -> str:
        return f"FOR SHARE OF {of}"

    def notify(self) -> None:
        # Delivered at COMMIT to every node's kick listener (and dropped on rollback).
        if not self._notified:
            self._cur.execute("SELECT pg_notify(%s, '')", (KICK_CHANNEL,))
            self._notified = True

    def advisory_lock(self, key: str) -> None:
        self._cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))

    def try_advisory_lock(self, key: str) -> bool:
        self._cur.execute("SELECT pg_try_advisory_xact_lock(hashtext(%s))", (key,))
        row = self._cur.fetchone()
        return bool(row and row[0])


class PostgresStore(SqlStore):
    """Engine state in PostgreSQL at ``url`` (``postgresql://…``), pooled connections."""

    def __init__(self, url: str, *, min_size: int = 2, max_size: int = 8) -> None:
        super().__init__()
        self.url = url.replace("postgres://", "postgresql://", 1)
        self._pool = ConnectionPool(
            self.url, min_size=min_size, max_size=max_size, open=False, kwargs={"autocommit": True}
        )
        self._open = False

    # lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        if self._open:
            return
        await trio.to_thread.run_sync(self._open_sync)
        self._open = True

    def _open_sync(self) -> None:
        self._pool.open(wait=True, timeout=30.0)
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            # Two nodes starting together must not race on CREATE … IF NOT EXISTS.
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            for stmt in statements("postgres"):
                cur.execute(stmt)
            for table, column, kind in added_columns("postgres"):
                cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}")
            for stmt in backfill_statements("postgres"):
                cur.execute(stmt)

    async def close(self) -> None:
        if not self._open:
            return
        self._open = False
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._pool.close)

    async def reclaim_space(self, max_pages: int) -> int:
        """Nothing to do: autovacuum makes deleted rows' space reusable (it does
        not shrink the files; ``VACUUM FULL`` would, under an exclusive lock)."""
        await trio.lowlevel.checkpoint()
        return 0

    async def advance_clock(self, seconds: float) -> None:
        def work(tx: Tx) -> None:
            tx.execute("UPDATE clock_skew SET skew = skew + ? WHERE id = 1", (float(seconds),))

        await self._transact(work)

    async def watch_kicks(
        self,
        on_kick: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """LISTEN on a dedicated connection; call ``on_kick`` (on the Trio thread)
        for every notification until cancelled. A lost connection raises."""
        stop = threading.Event()
        listening = threading.Event()
        token = trio.lowlevel.current_trio_token()

        def listen() -> None:
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(f"LISTEN {KICK_CHANNEL}")
                listening.set()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=LISTEN_POLL_S, stop_after=1):
                        token.run_sync_soon(on_kick)

        async with trio.open_nursery() as nursery:

            async def listener() -> None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(listen)

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

    # transactions -----------------------------------------------------------------

    async def _transact(self, work: Callable[[Tx], T]) -> T:
        held: list[psycopg.Connection[Any]] = []
        finished = False

        def run() -> T:
            for attempt in range(1, TX_ATTEMPTS + 1):
                try:
                    with self._pool.connection() as conn:
                        held.append(conn)
                        try:
                            with conn.transaction():
                                return work(_PgTx(conn))
                        finally:
                            held.clear()
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    # PostgreSQL rolled the whole transaction back: it had no
                    # effect, and every method is one closure, so run it again.
                    if attempt == TX_ATTEMPTS:
                        raise
                    time.sleep(TX_RETRY_BACKOFF_S * attempt)
            raise AssertionError("unreachable")

        async def interrupt_on_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:
                if not finished and held:
                    held[0].cancel_safe(timeout=5.0)

        result: outcome.Outcome[T]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(interrupt_on_cancel)
            with trio.CancelScope(shield=True):
                result = await outcome.acapture(trio.to_thread.run_sync, run)
            finished = True
            nursery.cancel_scope.cancel()
        return result.unwrap()
