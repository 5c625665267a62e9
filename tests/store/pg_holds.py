"""What the PostgreSQL store tests use to force an interleaving: a store whose
transaction runs a hook between two statements (:class:`HookedStore`, and the
``store`` fixture opening one), a second connection holding a lock while a
store call runs (:func:`beside_a_holder`), the waits on PostgreSQL's lock
table, and the small steps the race tests share. Imported by the test modules
and ``tests/store/conftest.py``; no tests here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
import trio

from ironflow.protocol import FunctionDef, Trigger, WaitYield
from ironflow.store import Fence
from ironflow.store.postgres import PostgresStore

# How long a hook inside a transaction waits for the other side of its
# interleaving before it gives up (a bound on a failure, not a timing guess).
HOOK_WAIT_S = 10.0
FUNCTION = FunctionDef(id="racer", triggers=[Trigger("race.start")])


class HookedStore(PostgresStore):
    """A PostgresStore whose transactions call ``before(sql)`` ahead of each
    statement and ``after()`` once their work is done, before the commit (in
    the database actor's thread, inside the transaction)."""

    before: Callable[[str], None] | None = None
    after: Callable[[], None] | None = None

    async def _transact(self, work: Callable[[Any], Any], *args: Any, **kwargs: Any) -> Any:
        before, after = self.before, self.after

        def hooked(tx: Any) -> Any:
            result = work(tx if before is None else _HookedTx(tx, before))
            if after is not None:
                after()
            return result

        return await super()._transact(hooked, *args, **kwargs)


class _HookedTx:
    def __init__(self, tx: Any, hook: Callable[[str], None]) -> None:
        self._tx = tx
        self._hook = hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)

    def execute(self, sql: str, params: Any = ()) -> Any:
        self._hook(sql)
        return self._tx.execute(sql, params)

    def fetchone(self, sql: str, params: Any = ()) -> Any:
        self._hook(sql)
        return self._tx.fetchone(sql, params)

    def fetchall(self, sql: str, params: Any = ()) -> Any:
        self._hook(sql)
        return self._tx.fetchall(sql, params)


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[HookedStore]:
    s = HookedStore(pg_url)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


def lock_waiters(url: str) -> int:
    """Backends of this database waiting for a lock right now."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
        ).fetchone()
        return int(row[0]) if row else 0


def wait_until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` (a database state, e.g. a lock waiter) until true or
    :data:`HOOK_WAIT_S` passes; whether it became true."""
    deadline = time.monotonic() + HOOK_WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


async def session_of(store: PostgresStore, functions: list[FunctionDef], slots: int = 20) -> str:
    session = await store.register_worker(
        node_id="n0", worker_id="w", mode="stream", max_concurrent_jobs=slots,
        functions=functions, session_expiry_s=600,
    )
    return session.session_id


async def reserved(store: PostgresStore, session_id: str, n: int) -> list[Fence]:
    """``n`` new runs of FUNCTION, each reserved for ``session_id``: their fences."""
    for i in range(n):
        await store.ingest_event("race.start", {"k": i}, None, idempotency_window_s=60)
    fences: list[Fence] = []
    while len(fences) < n:
        for res in await store.reserve_segments("n0", {session_id: frozenset({FUNCTION.id})}, n, reservation_expiry_s=600):
            a = res.assignment
            fences.append(Fence(session_id, a.run_id, a.execution_seq, a.lease_token))
    return sorted(fences, key=lambda f: f.run_id)


async def running(store: PostgresStore, n: int) -> list[Fence]:
    session_id = await session_of(store, [FUNCTION])
    fences = await reserved(store, session_id, n)
    for fence in fences:
        await store.activate_lease(fence, lease_expiry_s=600)
    return fences


def wait_for(key: int, timeout_s: float = 600) -> WaitYield:
    return WaitYield(event="race.go", timeout_at=time.time() + timeout_s, match="data.k", match_value=key)


async def step_status(store: PostgresStore, run_id: str, step_id: str) -> str | None:
    for step in (await store.get_run(run_id)).steps:
        if step.step_id == step_id:
            return step.status
    return None


# ── race 1: an ack from a removed session strands its run ──────────────────


async def beside_a_holder(
    url: str, holder: psycopg.Connection[Any], call: Callable[[], Any], end: str = "rollback"
) -> tuple[Any, bool]:
    """Run ``call`` (a store call) while ``holder``'s transaction holds its
    locks; its result, and whether it waited for one of them (then the holder
    ends with ``end``, "rollback" or "commit", so that it can finish)."""
    out: dict[str, Any] = {}

    async def run() -> None:
        out["result"] = await call()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        waited = await trio.to_thread.run_sync(
            lambda: wait_until(lambda: "result" in out or lock_waiters(url) > 0)
        ) and "result" not in out
        if waited:
            getattr(holder, end)()
    return out["result"], waited


def held_open(store: HookedStore) -> tuple[threading.Event, threading.Event]:
    """The next transaction of ``store`` stops after its work, before its
    commit, until ``release`` is set: (paused, release)."""
    paused, release = threading.Event(), threading.Event()

    def after() -> None:
        store.after = None
        paused.set()
        release.wait(HOOK_WAIT_S)

    store.after = after
    return paused, release


async def race_calls(
    a: HookedStore, pg_url: str, call_a: Callable[[], Awaitable[Any]], call_b: Callable[[], Awaitable[Any]]
) -> tuple[Any, Any, bool]:
    """Run ``call_a`` (a call on ``a``) held before its commit, and ``call_b``
    meanwhile; returns both results and whether ``call_b`` finished while
    ``call_a`` was held rather than waiting for one of its locks."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(HOOK_WAIT_S)

    a.after = hold
    results: dict[str, Any] = {}

    async def on_a() -> None:
        results["a"] = await call_a()

    async def on_b() -> None:
        results["b"] = await call_b()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_a)
            assert await trio.to_thread.run_sync(lambda: held.wait(HOOK_WAIT_S))
            a.after = None
            nursery.start_soon(on_b)
            blocked = await trio.to_thread.run_sync(
                lambda: wait_until(lambda: "b" in results or lock_waiters(pg_url) > 0)
            )
            assert blocked
            b_finished_while_held = "b" in results
            release.set()
    finally:
        release.set()
        a.after = None
    return results["a"], results["b"], b_finished_while_held
