"""Run control on PostgreSQL across nodes (issue #23 §4): two stores (two
nodes' connections) resume the same failed run at once; the run row's
``FOR UPDATE`` lock (ironflow/store/run_control.py) makes one win and the
other answer Conflict. The interleaving is forced, no sleeps: the first
resume's transaction is held open before its commit until the second waits
on the lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

from ironflow.protocol import ErrorInfo, FunctionDef, Trigger
from ironflow.store import Conflict, Fence
from ironflow.store.postgres import PostgresStore
from tests.store.test_pg_races import HOOK_WAIT_S, lock_waiters, wait_until

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


async def test_two_nodes_resuming_one_run_at_once_one_wins(pg_url: str) -> None:
    a, b = HeldStore(pg_url), PostgresStore(pg_url)
    await a.open()
    await b.open()
    try:
        s = await a.register_worker(
            node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1,
            functions=[FUNCTION], session_expiry_s=600,
        )
        await a.ingest_event("resume.race", {}, None, idempotency_window_s=60)
        (res,) = await a.reserve_segments("n1", {s.session_id: frozenset({FUNCTION.id})}, 1, reservation_expiry_s=60)
        f = Fence(s.session_id, res.assignment.run_id, res.assignment.execution_seq, res.assignment.lease_token)
        await a.activate_lease(f, lease_expiry_s=600)
        await a.record_step(f, step_id="one", name="one", status="completed", output=1)
        await a.record_step(f, step_id="two", name="two", status="failed", error=ErrorInfo("x"))
        await a.fail_job(f, ErrorInfo("x", retryable=False))

        b_started = threading.Event()
        waited: list[bool] = []

        def hold() -> None:  # in a's transaction, its run row locked
            a.after = None
            b_started.wait(HOOK_WAIT_S)
            waited.append(wait_until(lambda: lock_waiters(pg_url) > 0))

        a.after = hold
        outcomes: dict[str, Any] = {}

        async def resume(name: str, store: PostgresStore) -> None:
            if name == "b":
                b_started.set()
            try:
                outcomes[name] = await store.resume_run(f.run_id)
            except Conflict as exc:
                outcomes[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(resume, "a", a)
            with trio.fail_after(HOOK_WAIT_S):  # a holds its run row lock before b starts
                while a.after is not None:
                    await trio.sleep(0.01)
            nursery.start_soon(resume, "b", b)
        assert waited == [True], "the second resume did not wait for the first's row lock"
        assert not isinstance(outcomes["a"], Conflict) and outcomes["a"].steps_deleted == 1
        assert isinstance(outcomes["b"], Conflict)
        assert len(await a.list_queue()) == 1
        assert len(await a.list_audit(run_id=f.run_id, type="run.resumed")) == 1
    finally:
        await a.close()
        await b.close()

