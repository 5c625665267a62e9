"""SQLite-only behaviour: the group-commit writer and a test-driven clock."""

from __future__ import annotations

import pytest
import trio

from ironflow.protocol import FunctionDef, Trigger
from ironflow.store import StaleExecution, open_store
from ironflow.store.base import Fence
from ironflow.store.sqlite import SqliteStore


async def test_clock_follows_mock_clock(autojump_clock, tmp_path):
    store = SqliteStore(str(tmp_path / "db"), now=lambda: 1.7e9 + autojump_clock.current_time())
    await store.open()
    try:
        start = await store.db_now()
        await trio.sleep(100)
        assert await store.db_now() == pytest.approx(start + 100)
        await store.advance_clock(5)
        assert await store.db_now() == pytest.approx(start + 105)
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


async def test_memory_path_uses_a_temporary_file():
    store = open_store(":memory:")
    await store.open()
    try:
        assert await store.db_now() > 1e9
    finally:
        await store.close()
