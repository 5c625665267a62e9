"""Run control on PostgreSQL across nodes (docs/run-control.md), each interleaving
forced, no sleeps: the first transaction is held open before its commit until
the second waits on its lock.

- Two stores (two nodes' connections) resume the same failed run at once:
  the run row's ``FOR UPDATE`` lock (ironflow/store/run_control.py) makes one
  win and the other answer Conflict.
- A paused run waiting for an event is resumed while the event arrives on the
  other node, in both orders: the wait step's row lock decides, and the run
  is queued exactly once — never left waiting on a step already settled."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

from ironflow.protocol import ErrorInfo, FunctionDef, Trigger, WaitYield
from ironflow.store import Conflict, Fence
from ironflow.store.postgres import PostgresStore
from tests.store.pg_holds import HOOK_WAIT_S, lock_waiters, wait_until

FUNCTION = FunctionDef(id="resumer", triggers=[Trigger("resume.race")])


class HeldStore(PostgresStore):
    """Calls ``after()`` inside each transaction, after its work, before commit."""

    after: Callable[[], None] | None = None

    async def _transact(self, work: Callable[[Any], Any], *args: Any, **kwargs: Any) -> Any:
        after = self.after

        def held(tx: Any) -> Any:
            result = work(tx)
            if after is not None:
                after()
            return result

        return await super()._transact(held, *args, **kwargs)


async def _running(store: PostgresStore) -> Fence:
    """A run of FUNCTION, its segment leased to a stream worker."""
    s = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1,
        functions=[FUNCTION], session_expiry_s=600,
    )
    await store.ingest_event("resume.race", {}, None, idempotency_window_s=60)
    (res,) = await store.reserve_segments("n1", {s.session_id: frozenset({FUNCTION.id})}, 1, reservation_expiry_s=60)
    f = Fence(s.session_id, res.assignment.run_id, res.assignment.execution_seq, res.assignment.lease_token)
    await store.activate_lease(f, lease_expiry_s=600)
    return f


async def _race(pg_url: str, held: HeldStore, first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run ``first`` (on ``held``) until its work is done, hold its transaction
    open, run ``second`` until it waits on a lock, then commit ``first``.
    Returns both outcomes; fails if ``second`` never waited."""
    second_started = threading.Event()
    waited: list[bool] = []

    def hold() -> None:
        held.after = None
        second_started.wait(HOOK_WAIT_S)
        waited.append(wait_until(lambda: lock_waiters(pg_url) > 0))

    held.after = hold
    out: dict[str, Any] = {}

    async def go(name: str, call: Callable[[], Any]) -> None:
        if name == "second":
            second_started.set()
        out[name] = await call()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go, "first", first)
        with trio.fail_after(HOOK_WAIT_S):
            while held.after is not None:
                await trio.sleep(0.01)
        nursery.start_soon(go, "second", second)
    assert waited == [True], "the second transaction did not wait for the first's lock"
    return out["first"], out["second"]


async def _conflict_or(call: Callable[[], Any]) -> Any:
    try:
        return await call()
    except Conflict as exc:
        return exc


async def test_two_nodes_resuming_one_run_at_once_one_wins(pg_url: str) -> None:
    a, b = HeldStore(pg_url), PostgresStore(pg_url)
    await a.open()
    await b.open()
    try:
        f = await _running(a)
        await a.record_step(f, step_id="one", name="one", status="completed", output=1)
        await a.record_step(f, step_id="two", name="two", status="failed", error=ErrorInfo("x"))
        await a.fail_job(f, ErrorInfo("x", retryable=False))
        # a holds the run row lock until b waits on it.
        first, second = await _race(
            pg_url, a, lambda: _conflict_or(lambda: a.resume_run(f.run_id)),
            lambda: _conflict_or(lambda: b.resume_run(f.run_id)),
        )
        assert not isinstance(first, Conflict) and first.steps_deleted == 1
        assert isinstance(second, Conflict)
        assert len(await a.list_queue()) == 1
        assert len(await a.list_audit(run_id=f.run_id, type="run.resumed")) == 1
    finally:
        await a.close()
        await b.close()


async def _paused_on_a_wait(store: PostgresStore) -> str:
    f = await _running(store)
    now = await store.db_now()
    await store.yield_job(f, step_id="w", name="w", info=WaitYield(event="go", timeout_at=now + 600))
    await store.pause_run(f.run_id)
    return f.run_id


async def test_a_resume_holding_the_wait_step_makes_the_event_resume_the_run(pg_url: str) -> None:
    a, b = HeldStore(pg_url), PostgresStore(pg_url)
    await a.open()
    await b.open()
    try:
        run_id = await _paused_on_a_wait(a)
        resumed, ingested = await _race(
            pg_url, a, lambda: a.resume_run(run_id),
            lambda: b.ingest_event("go", {}, None, idempotency_window_s=60),
        )
        assert resumed.status == "waiting"  # back on its wait, which the event then answered
        assert ingested.resumed_run_ids == [run_id]
        assert [q.run_id for q in await a.list_queue()] == [run_id]
        assert [(st.step_id, st.status) for st in (await a.get_run(run_id)).steps] == [("w", "completed")]
    finally:
        await a.close()
        await b.close()


async def test_an_event_holding_the_wait_step_makes_the_resume_queue_the_run(pg_url: str) -> None:
    a, b = HeldStore(pg_url), PostgresStore(pg_url)
    await a.open()
    await b.open()
    try:
        run_id = await _paused_on_a_wait(a)
        ingested, resumed = await _race(
            pg_url, a, lambda: a.ingest_event("go", {}, None, idempotency_window_s=60),
            lambda: b.resume_run(run_id),
        )
        assert ingested.resumed_run_ids == []  # the run was paused: the event settled its step only
        assert resumed.status == "waiting_for_capacity"  # the resume saw the step settled
        assert [q.run_id for q in await a.list_queue()] == [run_id]
        assert (await a.get_run(run_id)).run.status == "waiting_for_capacity"
    finally:
        await a.close()
        await b.close()
