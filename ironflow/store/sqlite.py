"""The embedded backend: one SQLite file in WAL mode, one writer thread, group commit.

Every write request is a closure queued to a single dedicated thread that
owns the write connection (reads that change nothing use a small pool of
read connections beside it: WAL readers never block the writer). The thread takes everything pending, runs it
in ONE ``BEGIN IMMEDIATE`` transaction with a SAVEPOINT per request (a failing
request rolls back only its own work), commits once, then hands each result
back to its Trio task with ``run_sync_soon``. The awaiting side waits shielded:
once a request is queued, its committed result is never dropped.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import outcome
import trio

from ironflow.store.availability import Availability, settle
from ironflow.store.base import StorageFull, StoreUnavailable
from ironflow.store.core import NamedLock, Tx
from ironflow.store.handback import hand_back
from ironflow.store.schema import migrate
from ironflow.store.sql import SqlStore

__all__ = ["SqliteStore"]

T = TypeVar("T")

# ``PRAGMA auto_vacuum`` value of a file whose free pages can be given back.
AUTO_VACUUM_INCREMENTAL = 2
# Most requests one group commit takes: bounds the latency of the first
# request in a burst while still amortising the fsync over many.
MAX_GROUP = 256
# Read connections (one thread each at most): reads (the API's, the
# dashboard's) run beside the writer, never queued behind its groups. WAL lets
# readers see the last commit without blocking it; more than a few would only
# contend for the GIL.
READERS = 4


# SQLite's primary result codes (the low byte of ``sqlite_errorcode``) that
# mean the file cannot be used now, not that the statement was wrong: each
# becomes StoreUnavailable, so the node waits the outage out.
_SQLITE_FULL = 13
_SQLITE_OUTAGES = {
    5: "the database file is locked by another process",  # SQLITE_BUSY, past busy_timeout
    8: "the database file or its directory is read-only",  # SQLITE_READONLY
    10: "the disk failed an I/O operation",  # SQLITE_IOERR
    14: "the database file cannot be opened",  # SQLITE_CANTOPEN
    15: "the database file's lock protocol failed",  # SQLITE_PROTOCOL
}


def _unavailable(exc: BaseException) -> StoreUnavailable | None:
    """The outage ``exc`` (a sqlite3 error) means, or None for any other error."""
    code = getattr(exc, "sqlite_errorcode", None)
    if not isinstance(exc, sqlite3.Error) or code is None:
        return None
    primary = code & 0xFF
    if primary == _SQLITE_FULL:
        return StorageFull(
            f"SQLite storage full: {exc} (free space on the state directory's file system;"
            " the node resumes by itself)"
        )
    why = _SQLITE_OUTAGES.get(primary)
    if why is None:
        return None
    return StoreUnavailable(f"SQLite unavailable: {why} ({exc})")


class _SqliteTx:
    """:class:`~ironflow.store.core.Tx` over the writer thread's connection."""

    modifying_with = False
    round_trips = False
    notifies_nodes = False
    streams_rows = True

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, params).rowcount

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        cur = self._conn.execute(sql, params)
        row = cur.fetchone()
        cur.fetchall()  # drain so RETURNING statements finish before the next one
        return row

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def iterate(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple[Any, ...]]:
        cur = self._conn.execute(sql, params)
        try:
            yield from cur
        finally:
            cur.close()  # a loop left early: the statement ends here, not at the next one

    def lock(self, of: str | None = None) -> str:
        return ""  # the single writer already serialises every transaction

    def lock_wait(self) -> str:
        return ""

    def share_lock(self, of: str) -> str:
        return ""

    def notify(self) -> None:
        pass  # one node per SQLite file: local kicks already cover it

    def take_notify(self) -> bool:
        return False

    def runs_ended(self, run_ids: list[str]) -> None:
        pass  # one node per SQLite file: its own listeners hear every run end

    def advisory_lock(self, key: str) -> None:
        pass

    def try_advisory_lock(self, key: str) -> bool:
        return True  # one node per file

    def key_share_lock(self, of: str) -> str:
        return ""

    def renew_lock(self, of: str) -> str:
        return ""

    # One writer at a time: commit order is statement order, no snapshot to record.
    xid_sql = "NULL"
    snapshot_sql = "NULL"


# Files made for `:memory:` stores; the store deletes its own on close.
_TEMPORARY_FILES: set[str] = set()


def sqlite_path(url: str) -> str:
    for prefix in ("sqlite:///", "sqlite://", "sqlite:"):
        if url.startswith(prefix):
            url = url[len(prefix) :]
            break
    if url in ("", ":memory:") or url.startswith("file::memory:"):
        # Several statements per request and WAL need a real file.
        fd, path = tempfile.mkstemp(prefix="ironflow-", suffix=".db")
        os.close(fd)
        _TEMPORARY_FILES.add(path)
        return path
    return url


class _Inline:
    """Stands in for a Trio token when the transaction ran on the Trio thread."""

    @staticmethod
    def run_sync_soon(deliver: Callable[[Any], None], result: Any) -> None:
        deliver(result)


# How long a connection waits for another's lock (PRAGMA busy_timeout), and
# how long a store opening the file retries the switch to WAL, which SQLite
# does not wait out by that timeout.
_BUSY_TIMEOUT_S = 5.0


def _to_wal(conn: sqlite3.Connection) -> None:
    """``PRAGMA journal_mode=WAL``, retried while another store opening the
    same new file holds its lock: SQLite answers that switch "database is
    locked" at once instead of calling the busy handler."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class SqliteStore(SqlStore):
    """Engine state in one SQLite file.

    ``now`` is called from the writer thread: pass something thread-safe such as
    ``lambda: 1.7e9 + mock_clock.current_time()``, never ``trio.current_time``.

    ``path``: a filesystem path, ``sqlite:///path``, or ``:memory:`` (a temp
    file). ``now``: the clock behind ``ironflow_now()`` (default
    ``time.time``); tests pass one driven by ``trio.testing.MockClock``.

    ``inline=True`` (virtual-time tests only) runs every transaction on the
    calling Trio thread instead of the writer thread: no thread ever holds a
    request, so ``MockClock(autojump_threshold=0)`` cannot jump while the
    database works, and ``now`` may then read ``trio.current_time()``.
    """

    def __init__(
        self,
        path: str,
        *,
        now: Callable[[], float] | None = None,
        inline: bool = False,
        auto_vacuum: bool = False,
    ) -> None:
        super().__init__()
        # Incremental auto-vacuum lets the janitor give purged pages back to the
        # file system, at ~10 % of write throughput (pointer-map pages on every
        # write, measured with bench.py): opt-in. Without it purged pages are
        # reused, so a database under retention stops growing but never shrinks.
        self._auto_vacuum = auto_vacuum
        self.path = sqlite_path(path)
        # A `:memory:` store lives in a temp file of ours: deleted on close.
        self._temporary = self.path in _TEMPORARY_FILES
        self._clock = now or time.time
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._inline = inline
        self._inline_conn: sqlite3.Connection | None = None
        self._readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._reader_slots = trio.CapacityLimiter(READERS)
        self.availability = Availability()

    def _db_clock(self) -> float:
        return self._clock()

    # lifecycle --------------------------------------------------------------------

    async def open(self) -> None:
        if self._inline:
            if self._inline_conn is None:
                self._inline_conn = self._connect()
            return
        if self._thread is not None:
            return
        ready: trio.Event = trio.Event()
        failure: list[BaseException] = []
        token = trio.lowlevel.current_trio_token()

        def started(exc: BaseException | None) -> None:
            if exc is not None:
                failure.append(exc)
            token.run_sync_soon(ready.set)

        self._thread = threading.Thread(
            target=self._writer, args=(started,), name="ironflow-sqlite-writer", daemon=True
        )
        self._thread.start()
        with trio.CancelScope(shield=True):
            await ready.wait()
        if failure:
            await trio.to_thread.run_sync(self._thread.join)
            self._thread = None
            raise failure[0]

    async def close(self) -> None:
        while True:
            try:
                self._readers.get_nowait().close()
            except queue.Empty:
                break
        if self._inline_conn is not None:
            self._inline_conn.close()
            self._inline_conn = None
        if self._thread is not None:
            self._requests.put(None)
            thread, self._thread = self._thread, None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)
        if self._temporary:
            _TEMPORARY_FILES.discard(self.path)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path + suffix)

    async def reclaim_space(self, max_pages: int) -> int:
        def work(tx: Tx) -> int:
            mode = tx.fetchone("PRAGMA auto_vacuum")
            if mode is None or mode[0] != AUTO_VACUUM_INCREMENTAL:
                return 0  # a file created without it: see docs/operations.md, History retention
            row = tx.fetchone("PRAGMA freelist_count")
            pages = min(int(row[0]) if row else 0, max_pages)
            # Each step of incremental_vacuum frees one page, and Python's
            # sqlite3 steps a statement without result columns only once:
            # hence one page per execute (~20 µs each, measured).
            for _ in range(pages):
                tx.execute("PRAGMA incremental_vacuum(1)")
            return pages

        return await self._transact(work)

    async def watch_kicks(
        self,
        on_kick: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One node per file: nothing to hear from other nodes."""
        task_status.started()
        await trio.sleep_forever()

    # the writer thread ------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        if self._auto_vacuum:
            # Only takes effect on a file that has no tables yet, so it must
            # come before the DDL; an older file keeps auto_vacuum off (docs/operations.md).
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        _to_wal(conn)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute(f"PRAGMA busy_timeout={round(_BUSY_TIMEOUT_S * 1000)}")
        conn.create_function("ironflow_now", 0, self._db_clock)
        conn.create_function("ironflow_clock", 0, self._db_clock)  # see schema.PG_CLOCK_FUNCTION
        # The write lock first: a second store opening the file waits (busy_timeout)
        # and then finds every migration applied.
        conn.execute("BEGIN IMMEDIATE")
        migrate(conn.cursor(), "sqlite")
        conn.execute("COMMIT")
        return conn

    def _writer(self, started: Callable[[BaseException | None], None]) -> None:
        try:
            conn = self._connect()
        except BaseException as exc:  # reported to open(), which re-raises it
            started(exc)
            return
        started(None)
        tx = _SqliteTx(conn)
        try:
            stop = False
            while not stop:
                batch = [self._requests.get()]
                while len(batch) < MAX_GROUP:
                    try:
                        batch.append(self._requests.get_nowait())
                    except queue.Empty:
                        break
                if None in batch:
                    stop = True
                    batch = [b for b in batch if b is not None]
                if batch:
                    self._commit_group(conn, tx, batch)
        finally:
            conn.close()

    @staticmethod
    def _commit_group(conn: sqlite3.Connection, tx: _SqliteTx, batch: list[Any]) -> None:
        works = [work for work, _, _ in batch]
        try:
            # Optimistic first: the whole group in one transaction with no
            # SAVEPOINT per request (two statements fewer per request). A
            # request that fails rolls the group back and it runs again with a
            # SAVEPOINT per request, so one request's error never undoes
            # another's work (the PostgreSQL actor does the same). Store work
            # is a pure function of the transaction, so running it again is safe.
            results = SqliteStore._run_group(conn, tx, works, isolated=False)
            if results is None:
                results = SqliteStore._run_group(conn, tx, works, isolated=True)
                assert results is not None
        except BaseException as exc:  # the whole group failed: every caller hears it
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            results = [outcome.Error(exc) for _ in batch]  # one each: an outcome unwraps once
        hand_back(
            (token, deliver, result)
            for (_, token, deliver), result in zip(batch, results, strict=True)
        )

    @staticmethod
    def _run_group(
        conn: sqlite3.Connection, tx: _SqliteTx, works: list[Callable[[Tx], Any]], *, isolated: bool
    ) -> list[outcome.Outcome[Any]] | None:
        """Run ``works`` in one transaction and commit. Not ``isolated``: the
        first failure rolls everything back and returns None (a group of one
        returns its error: there is nothing else to keep)."""
        results: list[outcome.Outcome[Any]] = []
        conn.execute("BEGIN IMMEDIATE")
        for work in works:
            if isolated:
                conn.execute("SAVEPOINT req")
            result = outcome.capture(work, tx)
            if isinstance(result, outcome.Error):
                if not isolated:
                    conn.execute("ROLLBACK")
                    return [result] if len(works) == 1 else None
                conn.execute("ROLLBACK TO req")
            if isolated:
                conn.execute("RELEASE req")
            results.append(result)
        conn.execute("COMMIT")
        return results

    # the read connections ---------------------------------------------------------

    def _reader(self) -> sqlite3.Connection:
        """A read connection: query-only, with the store's clock."""
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA query_only=ON")
        conn.execute(f"PRAGMA busy_timeout={round(_BUSY_TIMEOUT_S * 1000)}")
        conn.create_function("ironflow_now", 0, self._db_clock)
        conn.create_function("ironflow_clock", 0, self._db_clock)
        return conn

    def _read_in_thread(self, work: Callable[[Tx], T]) -> T:
        try:
            conn = self._readers.get_nowait()
        except queue.Empty:
            conn = self._reader()
        try:
            # One snapshot for every statement of the read (WAL: no writer waits).
            conn.execute("BEGIN")
            try:
                return work(_SqliteTx(conn))
            finally:
                conn.execute("COMMIT")
        finally:
            self._readers.put(conn)

    async def _read(self, work: Callable[[Tx], T]) -> T:
        self.availability.check()
        if self._inline_conn is not None:
            return await self._transact(work)  # virtual-time tests: one connection
        if self._thread is None:
            raise RuntimeError("SqliteStore is not open")
        result = await outcome.acapture(
            partial(trio.to_thread.run_sync, self._read_in_thread, work, limiter=self._reader_slots)
        )
        return settle(self.availability, result, _unavailable)

    # the Trio side ----------------------------------------------------------------

    async def _transact(
        self,
        work: Callable[[Tx], T],
        locks: Sequence[NamedLock] = (),
        *,
        synchronous_commit: bool = True,
    ) -> T:
        # ``locks`` need nothing here: the single writer runs one transaction at
        # a time; nor ``synchronous_commit``: with PRAGMA synchronous=NORMAL (WAL)
        # no commit waits for an fsync.
        self.availability.check()
        return await self._write(work)

    async def _outage_transact(self, work: Callable[[Tx], T]) -> T:
        """The monitor's write probe and give-back: tried even while the
        store is known down (that is what they are for)."""
        return await self._write(work)

    async def _write(self, work: Callable[[Tx], T]) -> T:
        """``work`` in the writer's next group commit (or inline)."""
        if self._inline_conn is not None:
            inline_box: list[outcome.Outcome[T]] = []
            self._commit_group(
                self._inline_conn,
                _SqliteTx(self._inline_conn),
                [(work, _Inline, inline_box.append)],
            )
            await trio.lowlevel.checkpoint()
            return settle(self.availability, inline_box[0], _unavailable)
        if self._thread is None:
            raise RuntimeError("SqliteStore is not open")
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        self._requests.put((work, trio.lowlevel.current_trio_token(), deliver))
        # Shielded: a request in the writer's hands will commit; its result must
        # reach the caller (cancellation is delivered at the next checkpoint).
        with trio.CancelScope(shield=True):
            await done.wait()
        return settle(self.availability, box[0], _unavailable)
