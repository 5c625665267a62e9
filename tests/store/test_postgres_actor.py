"""The PostgreSQL database actor: group commit, per-call isolation of failures,
cancellation of waiting callers, deadlock victims retried.

These drive ``PostgresStore._transact`` with closures of their own over a
scratch table, so each property is shown on its own, independent of the
store's SQL.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import psycopg
import pytest
import trio

from ironflow.store import postgres
from ironflow.store.core import Tx, lock_id
from ironflow.store.pg_tx import PgTx as _PgTx
from ironflow.store.postgres import PostgresStore

# Long enough for a blocked actor thread to be noticed as blocked, short for a test.
SETTLE_S = 0.2


def create_scratch(url: str) -> None:
    """The table the calls of these tests write."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE scratch (k TEXT PRIMARY KEY, n INT NOT NULL DEFAULT 0)")


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PostgresStore]:
    """One store with ONE actor connection, so queued calls form one group."""
    create_scratch(pg_url)
    s = PostgresStore(pg_url, connections=1)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


def rows(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {k: n for k, n in conn.execute("SELECT k, n FROM scratch").fetchall()}


def insert(key: str) -> Callable[[Tx], int]:
    """A call that inserts ``key`` and returns its transaction id."""

    def work(tx: Tx) -> int:
        tx.execute("INSERT INTO scratch (k) VALUES (?)", (key,))
        row = tx.fetchone("SELECT txid_current()")
        assert row is not None
        return int(row[0])

    return work


class Gate:
    """A call that holds the actor thread until opened, so later calls queue up."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def work(self, tx: Tx) -> None:
        self.entered.set()
        self.opened.wait(10)

    async def hold(self, store: PostgresStore, nursery: trio.Nursery) -> None:
        nursery.start_soon(store._transact, self.work)
        await trio.to_thread.run_sync(self.entered.wait, 10)


async def queue_behind(
    gate: Gate, store: PostgresStore, nursery: trio.Nursery, keys: tuple[str, ...], txids: dict[str, int]
) -> None:
    """Hold a group open at ``gate``, then queue one insert per key behind it;
    each call records its transaction id in ``txids`` once it commits."""

    async def call(key: str) -> None:
        txids[key] = await store._transact(insert(key))

    await gate.hold(store, nursery)
    for key in keys:
        nursery.start_soon(call, key)
    await trio.sleep(SETTLE_S)  # all of them are queued behind the gate


async def test_calls_queued_together_share_one_transaction_and_one_commit(store, pg_url):
    gate = Gate()
    txids: dict[str, int] = {}
    async with trio.open_nursery() as nursery:
        await queue_behind(gate, store, nursery, ("a", "b", "c", "d"), txids)
        gate.opened.set()
    assert len(set(txids.values())) == 1
    assert rows(pg_url) == {"a": 0, "b": 0, "c": 0, "d": 0}


@pytest.fixture
def two_actors(pg_url: str, postgres_store: PostgresStore) -> PostgresStore:
    """A store with the default two actor connections, and the scratch table."""
    create_scratch(pg_url)
    return postgres_store


async def test_calls_queued_behind_the_group_on_duty_wait_for_it_not_for_another_connection(
    two_actors, pg_url, monkeypatch
):
    # The second actor stays out while the group on duty is not stuck: the
    # calls form the next group, on the same connection, after it.
    monkeypatch.setattr(postgres, "RELIEF_AFTER_S", 30.0)
    gate = Gate()
    txids: dict[str, int] = {}
    async with trio.open_nursery() as nursery:
        await queue_behind(gate, two_actors, nursery, ("a", "b", "c"), txids)
        assert txids == {} and rows(pg_url) == {}  # none ran beside the held group
        gate.opened.set()
    assert len(set(txids.values())) == 1
    assert rows(pg_url) == {"a": 0, "b": 0, "c": 0}


async def test_a_group_on_duty_stuck_past_the_relief_time_is_relieved_by_another_connection(
    two_actors, pg_url, monkeypatch
):
    relief_s = 0.3
    monkeypatch.setattr(postgres, "RELIEF_AFTER_S", relief_s)
    gate = Gate()
    async with trio.open_nursery() as nursery:
        await gate.hold(two_actors, nursery)
        held_at = trio.current_time()
        with trio.fail_after(5):
            await two_actors._transact(insert("a"))  # answered while the gate is still shut
        waited = trio.current_time() - held_at
        assert rows(pg_url) == {"a": 0} and not gate.opened.is_set()
        gate.opened.set()
    assert relief_s * 0.9 <= waited < relief_s + 2.0


async def test_a_failing_call_is_rolled_back_alone_and_the_others_in_its_group_commit(
    store, pg_url
):
    gate = Gate()
    results: dict[str, Any] = {}

    def fails_after_writing(tx: Tx) -> None:
        tx.execute("INSERT INTO scratch (k) VALUES (?)", ("python-error",))
        raise ValueError("refused after writing")

    def violates_a_constraint(tx: Tx) -> None:
        tx.execute("INSERT INTO scratch (k) VALUES (?)", ("sql-error",))
        tx.execute("INSERT INTO scratch (k) VALUES (?)", ("a",))  # duplicate key

    async def call(name: str, work: Callable[[Tx], Any]) -> None:
        try:
            results[name] = await store._transact(work)
        except Exception as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        await gate.hold(store, nursery)
        nursery.start_soon(call, "a", insert("a"))
        await trio.sleep(SETTLE_S / 4)
        nursery.start_soon(call, "python-error", fails_after_writing)
        await trio.sleep(SETTLE_S / 4)
        nursery.start_soon(call, "sql-error", violates_a_constraint)
        await trio.sleep(SETTLE_S / 4)
        nursery.start_soon(call, "b", insert("b"))
        await trio.sleep(SETTLE_S)
        gate.opened.set()
    assert isinstance(results["python-error"], ValueError)
    assert isinstance(results["sql-error"], psycopg.errors.UniqueViolation)
    assert results["a"] == results["b"]  # one group, one transaction
    assert rows(pg_url) == {"a": 0, "b": 0}
    # The connection is healthy afterwards.
    await store._transact(insert("c"))
    assert "c" in rows(pg_url)


async def test_a_cancelled_caller_whose_call_is_still_queued_withdraws_it(store, pg_url):
    gate = Gate()
    ran = threading.Event()

    def work(tx: Tx) -> None:
        ran.set()
        tx.execute("INSERT INTO scratch (k) VALUES (?)", ("withdrawn",))

    async with trio.open_nursery() as nursery:
        await gate.hold(store, nursery)
        with trio.move_on_after(SETTLE_S) as scope:
            await store._transact(work)
        assert scope.cancelled_caught
        gate.opened.set()
    await store._transact(insert("after"))
    assert not ran.is_set()
    assert rows(pg_url) == {"after": 0}


async def test_a_cancelled_caller_whose_call_is_running_gets_its_committed_result(
    store, pg_url
):
    running = threading.Event()
    release = threading.Event()
    got: list[int] = []

    def work(tx: Tx) -> int:
        running.set()
        release.wait(10)
        return insert("ran")(tx)

    async def caller(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            got.append(await store._transact(work))
            await trio.sleep_forever()  # the next checkpoint delivers the cancellation

    async with trio.open_nursery() as nursery:
        scope = await nursery.start(caller)
        await trio.to_thread.run_sync(running.wait, 10)
        scope.cancel()
        await trio.sleep(SETTLE_S)
        assert not got  # still waiting: its call is in the actor's hands
        release.set()
    assert len(got) == 1
    assert rows(pg_url) == {"ran": 0}
    await store._transact(insert("after"))  # the connection was left in a good state
    assert rows(pg_url) == {"ran": 0, "after": 0}


async def test_a_deadlock_victim_is_rolled_back_alone_and_retried(pg_url):
    """Two nodes (one connection each) lock two rows in opposite orders.

    PostgreSQL aborts one as the deadlock victim; the victim's group also holds
    another call, which must commit exactly once, and the victim is run again
    until it commits: every increment lands exactly once.
    """
    create_scratch(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO scratch (k) VALUES ('x'), ('y'), ('by-0'), ('by-1')")
    nodes = [PostgresStore(pg_url, connections=1), PostgresStore(pg_url, connections=1)]
    first_locks = [threading.Event(), threading.Event()]
    attempts = [0, 0]

    def crossing(i: int) -> Callable[[Tx], None]:
        mine, theirs = ("x", "y") if i == 0 else ("y", "x")

        def work(tx: Tx) -> None:
            attempts[i] += 1
            tx.execute("UPDATE scratch SET n = n + 1 WHERE k = ?", (mine,))
            first_locks[i].set()
            first_locks[1 - i].wait(10)
            tx.execute("UPDATE scratch SET n = n + 1 WHERE k = ?", (theirs,))

        return work

    def bystander(i: int) -> Callable[[Tx], None]:
        def work(tx: Tx) -> None:
            tx.execute("UPDATE scratch SET n = n + 1 WHERE k = ?", (f"by-{i}",))

        return work

    for node in nodes:
        await node.open()
    try:
        gates = [Gate(), Gate()]
        async with trio.open_nursery() as nursery:
            for i, node in enumerate(nodes):
                await gates[i].hold(node, nursery)
                nursery.start_soon(node._transact, bystander(i))
                await trio.sleep(SETTLE_S / 4)
                nursery.start_soon(node._transact, crossing(i))
            await trio.sleep(SETTLE_S)
            for gate in gates:
                gate.opened.set()
    finally:
        for node in nodes:
            await node.close()
    assert rows(pg_url) == {"x": 2, "y": 2, "by-0": 1, "by-1": 1}
    assert max(attempts) >= 2  # the victim ran again


def test_run_end_notifications_split_ids_under_the_notify_payload_limit() -> None:
    from ironflow.store.postgres import NOTIFY_PAYLOAD_MAX, _id_payloads

    ids = [f"run_{i:026d}" for i in range(2000)]  # 30 chars each: ~62 KB in all
    payloads = _id_payloads(ids)
    assert len(payloads) > 1
    assert all(len(p.encode()) <= NOTIFY_PAYLOAD_MAX for p in payloads)
    assert [i for p in payloads for i in p.split(",")] == ids
    assert _id_payloads([]) == []


async def test_a_chain_runs_in_one_transaction_in_order_on_one_of_several_connections(pg_url):
    create_scratch(pg_url)
    store = PostgresStore(pg_url, connections=2)
    await store.open()
    chains: dict[int, list[Any]] = {}

    def sees(key: str, earlier: str) -> Callable[[Tx], tuple[int, bool]]:
        def work(tx: Tx) -> tuple[int, bool]:
            txid = insert(key)(tx)
            return txid, tx.fetchone("SELECT 1 FROM scratch WHERE k = ?", (earlier,)) is not None

        return work

    async def chain(i: int) -> None:
        works = [insert(f"{i}-0"), sees(f"{i}-1", f"{i}-0"), sees(f"{i}-2", f"{i}-1")]
        chains[i] = [r.unwrap() for r in await store._transact_many([(w, ()) for w in works])]

    try:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(chain, i)
    finally:
        await store.close()
    for first, (txid1, saw0), (txid2, saw1) in chains.values():
        assert first == txid1 == txid2 and saw0 and saw1
    assert len(rows(pg_url)) == 60


async def test_a_retried_call_of_a_chain_takes_the_rest_of_its_chain_with_it(store, pg_url):
    attempts = {"n": 0}

    def serialization_failure_once(tx: Tx) -> None:
        # Run optimistically (fails: the group goes careful), then under its
        # savepoint (fails: put off to the next group), then it succeeds.
        attempts["n"] += 1
        if attempts["n"] <= 2:
            raise psycopg.errors.SerializationFailure("could not serialize (test)")
        tx.execute("INSERT INTO scratch (k) VALUES (?)", ("first",))

    def after_first(tx: Tx) -> bool:
        tx.execute("INSERT INTO scratch (k) VALUES (?)", ("second",))
        return tx.fetchone("SELECT 1 FROM scratch WHERE k = ?", ("first",)) is not None

    results = await store._transact_many(
        [(w, ()) for w in (insert("other"), serialization_failure_once, after_first)]
    )
    other, first, second = (r.unwrap() for r in results)
    assert isinstance(other, int) and first is None
    assert second is True  # ran after the retried call, not before it
    assert attempts["n"] == 3 and set(rows(pg_url)) == {"other", "first", "second"}


def recording_store(url: str) -> tuple[PostgresStore, list[str]]:
    """A one-connection store recording the actor's own statements (BEGIN,
    named locks, COMMIT…) in the order they were sent."""
    sent: list[str] = []

    class RecordingTx(_PgTx):
        def raw(self, sql: str) -> None:
            sent.append(sql)
            super().raw(sql)

    class RecordingStore(PostgresStore):
        tx_class = RecordingTx

    return RecordingStore(url, connections=1), sent


async def actor_backend_state(store: PostgresStore, url: str, state: str) -> None:
    """Until the actor's backend is in ``state`` (pg_stat_activity)."""
    [pid] = store.own_backends
    with psycopg.connect(url, autocommit=True) as conn, trio.fail_after(10):
        while conn.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() != (state,):
            await trio.sleep(0.01)


@pytest.fixture
async def recorded(pg_url: str) -> AsyncIterator[tuple[PostgresStore, list[str]]]:
    create_scratch(pg_url)
    store, sent = recording_store(pg_url)
    await store.open()
    try:
        yield store, sent
    finally:
        await store.close()


async def test_a_group_queued_behind_a_commit_runs_in_the_transaction_that_commit_began(recorded, pg_url):
    """A commit with calls queued behind it begins the next transaction in
    the same round trip, and the next group sends no BEGIN of its own; the
    last group, with nothing queued, leaves no transaction open."""
    store, sent = recorded
    gate = Gate()
    txids: list[int] = []

    async def call(key: str) -> None:
        txids.append(await store._transact(insert(key)))

    async with trio.open_nursery() as nursery:
        await gate.hold(store, nursery)
        nursery.start_soon(call, "a")
        await trio.sleep(SETTLE_S)  # queued behind the gate
        gate.opened.set()
    assert sent == ["BEGIN", "COMMIT; BEGIN", "COMMIT"]
    assert rows(pg_url) == {"a": 0} and len(txids) == 1
    await actor_backend_state(store, pg_url, "idle")
    # The next call, alone, begins its own transaction again.
    await call("b")
    assert sent[3:] == ["BEGIN", "COMMIT"] and rows(pg_url) == {"a": 0, "b": 0}


async def test_a_begun_transaction_sees_what_another_connection_committed_after_its_begin(recorded, pg_url):
    """READ COMMITTED: the transaction the gate's COMMIT began has run no
    statement, so it holds no snapshot; a row a second connection commits
    after that BEGIN and before the queued group's first statement is read
    by it."""
    store, sent = recorded
    gate = Gate()
    seen: list[Any] = []

    def after_another_commit(tx: Tx) -> None:
        # Runs after the gate's COMMIT; BEGIN, before this group's first statement.
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("INSERT INTO scratch (k) VALUES ('other')")
        seen.append(tx.fetchall("SELECT k FROM scratch ORDER BY k"))

    async with trio.open_nursery() as nursery:
        await gate.hold(store, nursery)
        nursery.start_soon(store._transact, after_another_commit)
        await trio.sleep(SETTLE_S)  # queued behind the gate
        gate.opened.set()
    assert sent == ["BEGIN", "COMMIT; BEGIN", "COMMIT"]  # the group ran in the begun transaction
    assert seen == [[("other",)]]


async def test_a_begun_transaction_no_group_came_for_is_rolled_back_before_the_actor_waits(recorded, pg_url):
    """The call queued behind the commit was withdrawn by its cancelled
    caller: the transaction begun for it is rolled back, not left open."""
    store, sent = recorded
    gate = Gate()
    async with trio.open_nursery() as nursery:
        await gate.hold(store, nursery)
        with trio.move_on_after(SETTLE_S):
            await store._transact(insert("withdrawn"))
        gate.opened.set()
    assert sent == ["BEGIN", "COMMIT; BEGIN"]  # the gate's commit began one for the queued call
    await actor_backend_state(store, pg_url, "idle")  # not "idle in transaction"
    assert rows(pg_url) == {}


async def test_a_group_in_a_begun_transaction_still_takes_its_named_locks_first(recorded, pg_url):
    """Named locks (``locks=``) are taken before the group's first statement
    whether the group sent BEGIN or its transaction was begun by the last
    commit: then they are the only statement of its ``begin``."""
    store, sent = recorded
    gate = Gate()
    held: list[int] = []

    def advisory_locks_held(tx: Tx) -> None:
        row = tx.fetchone(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        assert row is not None
        held.append(int(row[0]))

    async with trio.open_nursery() as nursery:
        await gate.hold(store, nursery)
        nursery.start_soon(partial(store._transact, advisory_locks_held, [("scratch:k", True)]))
        await trio.sleep(SETTLE_S)
        gate.opened.set()
    assert sent == ["BEGIN", "COMMIT; BEGIN", f"SELECT pg_advisory_xact_lock({lock_id('scratch:k')})", "COMMIT"]
    assert held == [1]


async def test_a_statement_is_planned_once_for_any_values_unless_its_plan_may_depend_on_one(store, pg_url):
    """A statement is prepared and run on its generic plan from its first
    execution (a group's statements have one text per row count, so
    PostgreSQL's default — the first five executions planned with their
    values — planned most of them anew); one with a range or a LIMIT on a
    parameter is never prepared: planned with its values every time."""

    def work(tx: Tx) -> list[tuple[Any, ...]]:
        for i in range(3):
            tx.execute("INSERT INTO scratch (k) VALUES (?), (?)", (f"a{i}", f"b{i}"))
        for limit in range(3):
            tx.fetchall("SELECT k FROM scratch WHERE n = ? ORDER BY k LIMIT ?", (0, limit))
            tx.fetchall("SELECT k FROM scratch WHERE n >= ?", (limit,))
        return tx.fetchall("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")

    [(statement, generic, custom)] = [
        row for row in await store._transact(work) if "pg_prepared_statements" not in row[0]
    ]
    assert statement.startswith("INSERT INTO scratch") and (generic, custom) == (3, 0)
