"""SQLite-only behaviour: the group-commit writer and a test-driven clock."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import pytest
import trio

from ironflow.protocol import FunctionDef, Trigger
from ironflow.store import StaleExecution, open_store
from ironflow.store.records import Fence
from ironflow.store.sqlite import SqliteStore
from tests.clock import SkewedSqliteStore


async def test_clock_follows_mock_clock(autojump_clock, tmp_path):
    store = SkewedSqliteStore(str(tmp_path / "db"), now=lambda: 1.7e9 + autojump_clock.current_time())
    await store.open()
    try:
        start = await store.db_now()
        await trio.sleep(100)
        assert await store.db_now() == pytest.approx(start + 100)
        await store.advance_clock(5)
        assert await store.db_now() == pytest.approx(start + 105)
    finally:
        await store.close()


async def test_a_caller_cancelled_while_the_writer_runs_its_call_gets_its_committed_result(tmp_path):
    """The wait for the writer is not abortable: the write commits, the caller
    hears its result, and the cancellation comes at its next checkpoint."""
    store = SqliteStore(str(tmp_path / "db"))
    await store.open()
    running, release = threading.Event(), threading.Event()
    got: list[int] = []
    after: list[str] = []

    def work(tx) -> int:
        running.set()
        release.wait(10)
        tx.execute("CREATE TABLE scratch (k INTEGER)")
        return 7

    async def caller(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            got.append(await store._write(work))
            after.append("reached")
            await trio.sleep_forever()  # the next checkpoint delivers the cancellation
        after.append("cancelled")

    try:
        async with trio.open_nursery() as nursery:
            scope = await nursery.start(caller)
            await trio.to_thread.run_sync(running.wait, 10)
            scope.cancel()
            await trio.sleep(0.05)
            assert not got  # still waiting: its call is in the writer's hands
            release.set()
        assert got == [7] and after == ["reached", "cancelled"]
        assert await store._write(lambda tx: tx.fetchall("SELECT k FROM scratch")) == []  # committed
    finally:
        await store.close()


async def test_failing_request_does_not_poison_its_commit_group(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/nested/dir/ironflow.db")
    await store.open()
    try:
        await store.register_worker(
            node_id="n",
            worker_id="w",
            mode="stream",
            max_concurrent_jobs=1,
            functions=[FunctionDef(id="f", triggers=[Trigger("e")])],
            session_expiry_s=60,
        )
        errors: list[BaseException] = []

        async def good() -> None:
            await store.ingest_event("e", {}, None, idempotency_window_s=1)

        async def bad() -> None:
            try:
                await store.complete_job(Fence("ses", "run", 1, "t"), None)
            except StaleExecution as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(bad if i % 2 else good)
        assert len(errors) == 20
        assert len(await store.list_runs(limit=100)) == 20
    finally:
        await store.close()


async def test_a_failing_request_loses_its_own_writes_and_its_group_keeps_theirs(tmp_path):
    # The writer runs a group optimistically without savepoints; a failure
    # must roll back only the failing request's writes, wherever it falls.
    store = SqliteStore(str(tmp_path / "db"))
    await store.open()
    insert = "INSERT INTO audit_log (id, at, type, data) VALUES (?, 0, 'test', '{}')"

    def good(i: int):
        return lambda tx: tx.execute(insert, (f"good{i}",))

    def bad(i: int):
        def work(tx):
            tx.execute(insert, (f"bad{i}",))
            raise RuntimeError("boom")

        return work

    failures: list[BaseException] = []

    async def call(work) -> None:
        try:
            await store._transact(work)
        except RuntimeError as exc:
            failures.append(exc)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(call, bad(i) if i % 3 == 1 else good(i))
        ids = await store._transact(lambda tx: [r[0] for r in tx.fetchall("SELECT id FROM audit_log")])
        assert len(failures) == 20
        assert sorted(ids) == sorted(f"good{i}" for i in range(60) if i % 3 != 1)
    finally:
        await store.close()


async def test_memory_path_uses_a_temporary_file():
    stores = [open_store(":memory:"), open_store("sqlite:///:memory:")]
    paths = [Path(s.path) for s in stores]  # type: ignore[attr-defined]
    try:
        for store in stores:
            await store.open()
        # A real file each (WAL and the writer thread need one), never shared.
        assert paths[0] != paths[1]
        for path in paths:
            assert path.parent == Path(tempfile.gettempdir()) and path.name.startswith("ironflow-")
            assert path.is_file() and path.stat().st_size > 0
        await stores[0].register_worker(
            node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1,
            functions=[FunctionDef(id="f", triggers=[Trigger("e")])], session_expiry_s=60,
        )
        assert len(await stores[0].list_sessions()) == 1
        assert await stores[1].list_sessions() == []
    finally:
        for store in stores:
            await store.close()
    # Closing removes the temp file and its WAL files: nothing piles up in /tmp.
    assert not [leftover for path in paths for leftover in path.parent.glob(path.name + "*")]


async def test_closing_a_file_store_keeps_its_file(tmp_path):
    store = open_store(str(tmp_path / "kept.db"))
    await store.open()
    await store.close()
    assert (tmp_path / "kept.db").is_file()


async def test_a_run_that_ended_exactly_retention_ago_stays_one_more_tick_goes(tmp_path):
    store = SkewedSqliteStore(str(tmp_path / "db"), now=lambda: 1.7e9)  # the clock moves only by skew
    await store.open()
    try:
        info = await store.register_worker(
            node_id="n", worker_id="w", mode="stream", max_concurrent_jobs=1,
            functions=[FunctionDef(id="f", triggers=[Trigger("e")])], session_expiry_s=10**6,
        )
        await store.ingest_event("e", {}, None, idempotency_window_s=1)
        (res,) = await store.reserve_segments(
            "n", {info.session_id: frozenset({"f"})}, 1, reservation_expiry_s=60
        )
        a = res.assignment
        fence = Fence(info.session_id, a.run_id, a.execution_seq, a.lease_token)
        await store.activate_lease(fence, lease_expiry_s=60)
        await store.complete_job(fence, None)
        await store.advance_clock(3600)
        at_boundary = await store.purge_history(older_than_s=3600, idempotency_window_s=1, batch=10)
        assert at_boundary.runs == 0
        await store.advance_clock(0.001)
        assert (await store.purge_history(older_than_s=3600, idempotency_window_s=1, batch=10)).runs == 1
    finally:
        await store.close()


async def test_a_new_file_with_auto_vacuum_gives_purged_pages_back_to_the_file_system(tmp_path):
    path = tmp_path / "db"
    store = SkewedSqliteStore(str(path), auto_vacuum=True)
    await store.open()
    try:
        blob = {"pad": "x" * 4000}
        for _ in range(20):
            await store.ingest_events([("nobody.listens", blob, None)] * 50, idempotency_window_s=1)
        pages_before = _page_count(path)
        await store.advance_clock(10)
        purged = 0
        while (counts := await store.purge_history(
            older_than_s=1, idempotency_window_s=1, batch=500
        )).events:
            purged += counts.events
        assert purged == 1000
        released = 0
        while (n := await store.reclaim_space(1000)) > 0:
            released += n
        assert released > 900  # a page or more per 4 KB event
        assert _page_count(path) < pages_before - 900
    finally:
        await store.close()


async def test_a_file_made_without_auto_vacuum_reclaims_nothing_and_still_works(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    sqlite3.connect(path).execute("CREATE TABLE legacy (x)").connection.close()
    store = SkewedSqliteStore(str(path))
    await store.open()
    try:
        await store.ingest_events([("e", {"pad": "x" * 4000}, None)] * 50, idempotency_window_s=1)
        await store.advance_clock(10)
        assert (await store.purge_history(older_than_s=1, idempotency_window_s=1, batch=500)).events == 50
        assert await store.reclaim_space(1000) == 0
    finally:
        await store.close()


async def test_by_default_purged_pages_are_reused_not_given_back(tmp_path):
    path = tmp_path / "db"
    store = SkewedSqliteStore(str(path))
    await store.open()
    try:
        blob = {"pad": "x" * 4000}
        await store.ingest_events([("nobody.listens", blob, None)] * 200, idempotency_window_s=1)
        await store.advance_clock(10)
        while (await store.purge_history(older_than_s=1, idempotency_window_s=1, batch=500)).events:
            pass
        assert await store.reclaim_space(1000) == 0  # auto_vacuum off: nothing to give back
        pages = _page_count(path)
        await store.ingest_events([("nobody.listens", blob, None)] * 200, idempotency_window_s=1)
        assert _page_count(path) <= pages + 20  # the freed pages took the new events
    finally:
        await store.close()


def _page_count(path) -> int:
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA page_count").fetchone()[0])
    finally:
        conn.close()


async def test_reads_are_served_beside_the_writer_not_queued_behind_it(tmp_path):
    import time

    store = SqliteStore(str(tmp_path / "db"))
    await store.open()
    try:
        await store.register_worker(
            node_id="n", worker_id="w", mode="stream", max_concurrent_jobs=1,
            functions=[FunctionDef(id="f", triggers=[Trigger("e")])], session_expiry_s=60,
        )
        await store.ingest_event("e", {}, None, idempotency_window_s=1)
        read_took: list[float] = []

        async def slow_write() -> None:
            await store._transact(lambda tx: time.sleep(1.0))  # holds the writer for 1 s

        async def read() -> None:
            await trio.sleep(0.1)  # the writer is busy by now
            t0 = time.monotonic()
            runs = await store.list_runs()
            read_took.append(time.monotonic() - t0)
            assert len(runs) == 1  # and it sees the last commit

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_write)
            nursery.start_soon(read)
        assert read_took[0] < 0.5
    finally:
        await store.close()
