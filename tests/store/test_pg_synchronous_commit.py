"""Which PostgreSQL commits wait for their WAL flush (docs/isolation.md,
"Commits that do not wait for their WAL flush").

A streaming session's job acks (lease activations) commit with
``synchronous_commit`` off; every other commit — the ingest, the reservation,
step results, the completion, and any group an ack shares with them — waits
for its flush. Read inside each transaction (``current_setting``), and shown
by a crash: PostgreSQL killed (``pg_ctl -m immediate``) right after the acks
loses them and keeps the completion committed before them, and the fence
refuses the lost segments' writes while the runs complete once, anew.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing

from actors import session
from actors.directory import SessionDirectory
from actors.messages import Kick
from ironflow.config import Limits, NodeConfig, Timings
from ironflow.protocol import (
    ActiveJob,
    EngineMessage,
    FunctionDef,
    JobAck,
    JobCompleted,
    Register,
    Registered,
    StepCompleted,
    Trigger,
    WorkerMessage,
    job_id_for,
)
from ironflow.store import Fence, StaleExecution, StepResult
from ironflow.store.pg_tx import PgTx as _PgTx
from ironflow.store.postgres import PostgresStore
from ironflow.testing import ThrowawayPostgres
from tests.clock import SkewedPostgresStore

FN = FunctionDef(id="fn", triggers=[Trigger("go")])
CFG = NodeConfig(timings=Timings(), limits=Limits(max_slots_per_session=8))
# The activation statement (fence.py, ``_activate``) and the completion's
# (``_complete_many``): how a recorded transaction is told apart.
ACTIVATION_SQL = "DELETE FROM dispatch_queue d USING v JOIN worker_sessions"
COMPLETION_SQL = "UPDATE runs SET status = 'completed'"
# Longer than the crash test takes: the WAL writer does not flush an
# asynchronous commit on its own before PostgreSQL is killed (10 s is the
# setting's maximum). Autovacuum off: none of its commits flushes one either.
CRASH_SERVER_OPTIONS = "-c wal_writer_delay=10s -c autovacuum=off"

# synchronous_commit in force at COMMIT; whether the transaction wrote (it has
# a transaction id); its statements.
Commit = tuple[str, bool, list[str]]


def recording_store(url: str) -> tuple[PostgresStore, list[Commit]]:
    """A PostgresStore recording, for every transaction it commits, the
    ``synchronous_commit`` in force at its COMMIT, whether it wrote, and its
    statements."""
    commits: list[Commit] = []

    class RecordingTx(_PgTx):
        statements: list[str]

        def _run(self, sql: str, params: Any) -> int:
            self.statements.append(sql)
            return super()._run(sql, params)

        def executemany(self, sql: str, rows: Any) -> None:
            self.statements.append(sql)
            super().executemany(sql, rows)

        def begin(self, batch: Any) -> None:
            self.statements = []
            super().begin(batch)

        def commit(self, statements: list[str]) -> None:
            # The group's setting comes with its COMMIT (then NOTIFYs, COMMIT,
            # perhaps the next BEGIN): applied first, then read.
            setting = [s for s in statements if s.startswith("SET LOCAL")]
            for statement in setting:
                self.raw(statement)
            row = self.fetchone(
                "SELECT current_setting('synchronous_commit'),"
                " pg_current_xact_id_if_assigned() IS NOT NULL"
            )
            assert row is not None
            commits.append((str(row[0]), bool(row[1]), self.statements[:-1]))
            super().commit([s for s in statements if s not in setting])

    class RecordingStore(PostgresStore):
        tx_class = RecordingTx

    return RecordingStore(url, connections=1), commits


def with_statement(commits: list[Commit], sql: str) -> list[str]:
    """The setting of each recorded commit that ran a statement containing ``sql``."""
    return [setting for setting, _, statements in commits if any(sql in s for s in statements)]


@pytest.fixture
async def recorded(pg_url: str) -> AsyncIterator[tuple[PostgresStore, list[Commit]]]:
    store, commits = recording_store(pg_url)
    await store.open()
    try:
        yield store, commits
    finally:
        await store.close()


async def reserved(store: PostgresStore, session_id: str, n: int) -> list[Fence]:
    """``n`` new runs of FN reserved for ``session_id``: their fences, by run id."""
    for i in range(n):
        await store.ingest_event("go", {"i": i}, None, idempotency_window_s=60)
    found = await store.reserve_segments(
        "n1", {session_id: frozenset({FN.id})}, n, reservation_expiry_s=600
    )
    assert len(found) == n
    return sorted(
        (Fence(session_id, r.assignment.run_id, r.assignment.execution_seq, r.assignment.lease_token)
         for r in found),
        key=lambda f: f.run_id,
    )


async def session_of(store: PostgresStore) -> str:
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=8, functions=[FN],
        session_expiry_s=600,
    )
    return info.session_id


async def until_status(store: PostgresStore, run_id: str, status: str) -> None:
    with trio.fail_after(10):
        while (await store.get_run(run_id)).run.status != status:
            await trio.sleep(0.001)


async def test_a_session_s_acks_commit_without_waiting_for_the_flush_and_everything_it_reports_waits(
    recorded: tuple[PostgresStore, list[Commit]],
) -> None:
    """Through the session actor, as a worker's frames reach it: the ack's
    activation commits with synchronous_commit off; the registration, the
    ingest, the reservation and the job's step and result wait for theirs."""
    store, commits = recorded
    send, inbound = trio.open_memory_channel[WorkerMessage](10)
    outbox, received = trio.open_memory_channel[EngineMessage](10)
    kicks, _ = trio.open_memory_channel[Kick](100)
    async with trio.open_nursery() as nursery:
        await send.send(Register(worker_id="w1", functions=[FN], max_concurrent_jobs=2))
        session_id = await nursery.start(
            session.run, store, CFG, "n1", SessionDirectory(), kicks, inbound, outbox
        )
        with trio.fail_after(10):
            assert isinstance(await received.receive(), Registered)
        [fence] = await reserved(store, session_id, 1)
        job = job_id_for(fence.run_id, fence.execution_seq)
        await send.send(JobAck(job, fence.run_id, fence.execution_seq, fence.lease_token))
        await until_status(store, fence.run_id, "running")
        await send.send(StepCompleted(job, fence.run_id, fence.execution_seq, fence.lease_token,
                                      step_id="s1", name="s1", output=1))
        await send.send(JobCompleted(job, fence.run_id, fence.execution_seq, fence.lease_token,
                                     output="done"))
        await until_status(store, fence.run_id, "completed")
        await send.aclose()
    assert with_statement(commits, ACTIVATION_SQL) == ["off"]
    assert with_statement(commits, COMPLETION_SQL) == ["on"]
    writes = [setting for setting, wrote, statements in commits
              if wrote and not any(ACTIVATION_SQL in s for s in statements)]
    assert len(writes) >= 4 and set(writes) == {"on"}, writes  # register, ingest, reserve, completion


async def test_a_group_commit_waits_for_its_flush_unless_every_call_in_it_is_an_unflushed_ack(
    recorded: tuple[PostgresStore, list[Commit]],
) -> None:
    """The one actor held while calls queue, so the next group takes them
    together: two acks alone commit with synchronous_commit off; an ack in a
    group with a completion waits for the flush like the completion."""
    store, commits = recorded
    session_id = await session_of(store)
    first, second, third, done = await reserved(store, session_id, 4)
    await store.activate_lease(done, lease_expiry_s=600)

    async def group_of(*calls: Callable[[], Any]) -> list[Commit]:
        """``calls`` queued behind a held actor, then run as one group: its commits."""
        entered, release = threading.Event(), threading.Event()

        def held(tx: Any) -> None:
            entered.set()
            release.wait(10)

        before = len(commits)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store._transact, held)
            await trio.to_thread.run_sync(entered.wait, 10)  # the actor is in it
            for call in calls:
                nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        return commits[before:]

    def ack(fence: Fence) -> Callable[[], Any]:
        return lambda: store.activate_leases([fence], lease_expiry_s=600, synchronous_commit=False)

    acks = await group_of(ack(first), ack(second))
    assert [setting for setting, _, _ in acks] == ["on", "off"]  # the held call, then the acks
    assert sum(ACTIVATION_SQL in s for s in acks[1][2]) == 2  # both in that one group
    mixed = await group_of(ack(third), lambda: store.complete_jobs([(done, "ok", [])]))
    assert [setting for setting, _, _ in mixed] == ["on", "on"]
    assert any(ACTIVATION_SQL in s for s in mixed[1][2])
    assert any(COMPLETION_SQL in s for s in mixed[1][2])
    for fence in (first, second, third):
        assert (await store.get_run(fence.run_id)).run.status == "running"


@pytest.fixture
def crashable() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL of its own with its default durability, to be killed."""
    pg = ThrowawayPostgres(durable=True, server_options=CRASH_SERVER_OPTIONS)
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()


async def test_acks_lost_in_a_postgresql_crash_are_refused_and_their_runs_complete_once_anew(
    crashable: ThrowawayPostgres,
) -> None:
    """A completion, then two acks, then ``pg_ctl -m immediate``: after the
    restart the completion is there (it waited for its flush) and the acks
    are not (they did not). What they left is their reservations: the lost
    segments' writes are refused by the fence; once the reservations expire
    the runs are dispatched again under the same execution_seq with new
    lease tokens and complete once, their steps recorded once."""
    url = crashable.new_database()
    store = SkewedPostgresStore(url)
    await store.open()
    try:
        session_id = await session_of(store)
        kept, *lost = await reserved(store, session_id, 3)
        await store.activate_lease(kept, lease_expiry_s=600)
        [done] = await store.complete_jobs(
            [(kept, "kept", [StepResult("s1", "s1", "completed", output=1)])]
        )
        done.unwrap()
        before = {f.run_id: (await store.get_run(f.run_id)).run.status for f in lost}
        acked = await store.activate_leases(lost, lease_expiry_s=600, synchronous_commit=False)
        assert [a.unwrap().status for a in acked] == ["running", "running"]  # visible at once
    finally:
        await store.close()
    await trio.to_thread.run_sync(crashable.halt, "immediate")
    await trio.to_thread.run_sync(crashable.resume)

    store = SkewedPostgresStore(url)
    await store.open()
    try:
        detail = await store.get_run(kept.run_id)
        assert detail.run.status == "completed" and detail.run.output == "kept"
        assert [s.step_id for s in detail.steps] == ["s1"]
        assert not await store.list_leases()
        queued = {q.run_id: q for q in await store.list_queue()}
        for fence in lost:
            assert (await store.get_run(fence.run_id)).run.status == before[fence.run_id] != "running"
            row = queued[fence.run_id]  # the reservation, which waited for its flush
            assert row.reservation_owner == session_id and row.execution_seq == fence.execution_seq
        # The worker, not told of the loss, goes on: its writes are refused.
        old = lost[0]
        with pytest.raises(StaleExecution):
            await store.record_steps(old, [StepResult("s1", "s1", "completed", output="old")])
        with pytest.raises(StaleExecution):
            await store.complete_job(old, "old")
        job = ActiveJob(job_id_for(old.run_id, old.execution_seq), old.run_id, old.execution_seq,
                        old.lease_token)
        [status] = await store.heartbeat(session_id, [job], session_expiry_s=3600, lease_expiry_s=600)
        assert status.state == "REFRESHED"  # the reservation is still the worker's
        await store.advance_clock(601)
        assert await store.expire_reservations() == 2
        [status] = await store.heartbeat(session_id, [job], session_expiry_s=600, lease_expiry_s=600)
        assert status.state == "STALE"
        again = await store.reserve_segments(
            "n1", {session_id: frozenset({FN.id})}, 2, reservation_expiry_s=600
        )
        new = {r.assignment.run_id: r.assignment for r in again}
        assert set(new) == {f.run_id for f in lost}
        for fence in lost:
            a = new[fence.run_id]
            assert a.execution_seq == fence.execution_seq and a.lease_token != fence.lease_token
        fresh = [Fence(session_id, f.run_id, f.execution_seq, new[f.run_id].lease_token) for f in lost]
        for fence in fresh:
            await store.activate_lease(fence, lease_expiry_s=600)
        with pytest.raises(StaleExecution):
            await store.activate_lease(old, lease_expiry_s=600)  # a repeated old ack
        with pytest.raises(StaleExecution):
            await store.complete_job(old, "old")
        for fence in fresh:
            [done] = await store.complete_jobs(
                [(fence, "new", [StepResult("s1", "s1", "completed", output=2)])]
            )
            done.unwrap()
        for fence in lost:
            detail = await store.get_run(fence.run_id)
            assert detail.run.status == "completed" and detail.run.output == "new"
            assert [(s.step_id, s.output) for s in detail.steps] == [("s1", 2)]
    finally:
        await store.close()
