"""A node cut off from its PostgreSQL answers fast and rejoins.

The node reaches PostgreSQL through a :class:`~tests.blackhole.BlackholeProxy`
that is switched to hold every byte in both directions, closing nothing: what
a network partition looks like to both ends, where no error ever arrives.
What must hold:

- while blackholed, every request (emit, GET run, /healthz, /readyz) is
  answered within ANSWER_WITHIN_S, the store's with 503 ``STORE_UNAVAILABLE``
  and a ``Retry-After``; ``/readyz`` turns 503 within READY_WITHIN_S;
- after the heal ``/readyz`` is 200 again within READY_WITHIN_S, and every
  emit from then on succeeds; a run emitted then completes;
- a transaction left open on a blackholed connection, holding a row lock,
  is ended by the server at ``pg_idle_in_transaction_timeout_s``: a peer
  waiting for that row proceeds then, not before, and nothing of the held
  transaction is committed;
- a lock held by a session that is not a node's is given up at
  ``pg_lock_timeout_s``: ``STORE_TIMEOUT``, and the store stays up;
- a node stopped (at once, or by a drain) while cut off stops within its
  bounds, not when the database answers again; what it could not record is
  recovered by another node once the database is back: every run completes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
import trio

import ironflow
from actors import store_monitor
from ironflow.node import Node
from ironflow.store import StoreTimeout, StoreUnavailable
from ironflow.store.core import Tx
from ironflow.store.postgres import PostgresStore
from tests.blackhole import BlackholeProxy
from tests.integration.conftest import node_config
from tests.integration.helpers import emit, eventually, wait_for_run

# Wall-clock bounds: run alone, after the parallel phase (pyproject's markers).
pytestmark = [pytest.mark.serial]

# Every answer while the database is unreachable must come within this.
ANSWER_WITHIN_S = 1.0
# /readyz must change within this of the blackhole's start and of the heal.
READY_WITHIN_S = 2.0
# How long the link stays blackholed: past the idle-in-transaction bound
# below, so the server ends the sessions the node had open mid-transaction
# and the node must come back on fresh ones.
BLACKHOLE_S = 3.5
# The server-side bounds for these tests: short, so the test runs in seconds.
PG_BOUNDS: dict[str, Any] = {
    "pg_idle_in_transaction_timeout_s": 1.5,
    "pg_lock_timeout_s": 3.0,
    "pg_statement_timeout_s": 5.0,
    "pg_tcp_timeout_s": 2.0,
}
# Pause between two requests of one kind while the answers are recorded.
REQUEST_GAP_S = 0.05
# The peer of the lock test may not get its row before the bound minus this
# (scheduling slack), and must have it within the bound plus this.
LOCK_SLACK_S = 1.0


@pytest.fixture
def proxy(pg_url: str) -> Iterator[BlackholeProxy]:
    where = urlsplit(pg_url)
    with BlackholeProxy(where.hostname or "127.0.0.1", where.port or 5432) as p:
        yield p


class Recorder:
    """Sends one kind of request over and over; records (started, took, status, code)."""

    def __init__(self, http: httpx.AsyncClient, method: str, path: str, body: Any = None) -> None:
        self.http, self.method, self.path, self.body = http, method, path, body
        self.answers: list[tuple[float, float, int, str, str | None]] = []

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            r = await self.http.request(self.method, self.path, json=self.body)
            took = time.monotonic() - started
            code = r.json().get("code", "") if r.status_code >= 300 and self.path != "/readyz" else ""
            self.answers.append((started, took, r.status_code, code, r.headers.get("retry-after")))
            await trio.sleep(REQUEST_GAP_S)

    def between(self, start: float, end: float) -> list[tuple[float, float, int, str, str | None]]:
        return [a for a in self.answers if start <= a[0] < end]


async def test_a_node_cut_off_from_postgres_answers_fast_and_rejoins(
    proxy: BlackholeProxy, pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    config = node_config(proxy.url(pg_url), tmp_path / ".ironflow", **PG_BOUNDS)
    node: Node = await nursery.start(Node(config).run)

    @ironflow.function(id="echo", triggers=[ironflow.event("echo.go")])
    async def echo(ctx: Any) -> Any:
        return await ctx.step.run("echo", lambda: ctx.event.data)

    worker = ironflow.StreamingWorker(node.url, [echo], handle_signals=False)
    await nursery.start(worker.run)
    try:
        await _cut_off_and_rejoin(node, proxy)
    finally:
        proxy.heal()
        # A node stopped while its store is down waits for it (its sessions
        # hold the frames they could not apply): let it come back first.
        with trio.move_on_after(READY_WITHIN_S + 3):
            await node.store.availability.wait_up()
        worker.stop()
        node.stop()


async def _cut_off_and_rejoin(node: Node, proxy: BlackholeProxy) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=node.url, timeout=10.0, limits=limits) as http:
        before = (await emit(http, "echo.go", {"n": 0}))["run_ids"][0]
        assert (await wait_for_run(http, before))["run"]["status"] == "completed"
        recorders = [
            Recorder(http, "POST", "/v1/events", {"name": "echo.go", "data": {}}),
            Recorder(http, "GET", f"/v1/runs/{before}"),
            Recorder(http, "GET", "/healthz"),
            Recorder(http, "GET", "/readyz"),
        ]
        emits, reads, health, ready = recorders
        async with trio.open_nursery() as load:
            for r in recorders:
                load.start_soon(r.run)
            await trio.sleep(0.5)
            down_at = time.monotonic()
            proxy.blackhole()
            await trio.sleep(BLACKHOLE_S)
            healed_at = time.monotonic()
            proxy.heal()

            async def ready_again() -> float | None:
                return _ready_since(ready, healed_at)

            await eventually(ready_again, timeout=READY_WITHIN_S + 3, message="/readyz 200 after the heal")
            back_at = _ready_since(ready, healed_at)
            await trio.sleep(1.0)
            load.cancel_scope.cancel()

        # While blackholed: every request answered fast; the store's refused
        # with 503 STORE_UNAVAILABLE and a Retry-After; /healthz still 200.
        # (Before, during and after: no answer ever took longer, none was a 500.)
        for r in recorders:
            assert r.between(down_at, healed_at), f"no {r.method} {r.path} sent while blackholed"
            slowest = max(took for _, took, *_ in r.answers)
            assert slowest < ANSWER_WITHIN_S, f"{r.method} {r.path}: an answer took {slowest:.3f} s"
            assert all(status != 500 for _, _, status, *_ in r.answers)
        for r in (emits, reads):
            during = r.between(down_at, healed_at)
            assert all(s == 503 and c == "STORE_UNAVAILABLE" and ra for _, _, s, c, ra in during), during
        assert {s for _, _, s, *_ in health.between(down_at, healed_at)} == {200}
        unready = [at + took for at, took, s, *_ in ready.between(down_at, healed_at) if s == 503]
        assert unready and unready[0] - down_at < READY_WITHIN_S, "readyz did not fail in time"
        assert back_at is not None and back_at - healed_at < READY_WITHIN_S, "readyz did not recover in time"

        # Back: every emit sent once ready again succeeded, and its run completes.
        after = emits.between(back_at, float("inf"))
        assert after and all(s in (200, 201) for _, _, s, *_ in after), after
        run_id = (await emit(http, "echo.go", {"n": 1}))["run_ids"][0]
        assert (await wait_for_run(http, run_id))["run"]["output"] == {"n": 1}


def _ready_since(ready: Recorder, since: float) -> float | None:
    """When the first /readyz sent after ``since`` answered 200 (None: none yet)."""
    for at, took, status, *_ in ready.answers:
        if at >= since and status == 200:
            return at + took
    return None


async def test_a_transaction_held_on_a_blackholed_connection_releases_its_lock_at_the_bound(
    proxy: BlackholeProxy, pg_url: str
) -> None:
    config = node_config(proxy.url(pg_url), Path("/nonexistent"), **PG_BOUNDS)
    bound = config.timings.pg_idle_in_transaction_timeout_s
    with psycopg.connect(pg_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE held (id int PRIMARY KEY, v text)")
        setup.execute("INSERT INTO held VALUES (1, 'before')")
    store = PostgresStore(proxy.url(pg_url), timings=config.timings)
    await store.open()
    locked = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def hold(tx: Tx) -> None:
        # Runs on the store's own connection, with its session settings.
        tx.execute("UPDATE held SET v = 'node' WHERE id = 1")  # the row lock
        proxy.blackhole()
        token.run_sync_soon(locked.set)
        tx.execute("UPDATE held SET v = 'node again' WHERE id = 1")  # held by the blackhole

    outcome_box: list[BaseException | None] = []

    async def held_call() -> None:
        try:
            await store._transact(hold)
            outcome_box.append(None)
        except Exception as exc:
            outcome_box.append(exc)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(held_call)
            await locked.wait()
            blackholed_at = time.monotonic()

            def peer() -> float:
                with psycopg.connect(pg_url, autocommit=True) as conn:
                    conn.execute("UPDATE held SET v = 'peer' WHERE id = 1")
                return time.monotonic()

            proceeded_at = await trio.to_thread.run_sync(peer)
            waited = proceeded_at - blackholed_at
            assert bound - LOCK_SLACK_S <= waited <= bound + LOCK_SLACK_S, (
                f"the peer waited {waited:.2f} s for a row held on a blackholed connection "
                f"(idle-in-transaction bound {bound:g} s)"
            )
            proxy.heal()
        assert len(outcome_box) == 1 and isinstance(outcome_box[0], StoreUnavailable), outcome_box
        with psycopg.connect(pg_url, autocommit=True) as check:
            row = check.execute("SELECT v FROM held WHERE id = 1").fetchone()
        assert row == ("peer",)  # nothing of the held transaction committed
    finally:
        await store.close()



# A stop while cut off: the held frames given up, the silent connections
# waited for a second (ironflow/store/postgres.py ``close``); a drain: its
# deadline, then the same.
STOP_WITHIN_S = 3.0
DRAIN_TIMEOUT_S = 2.0


@pytest.mark.parametrize("how", ["stop", "drain"])
async def test_a_node_stopped_while_cut_off_stops_within_its_bounds_and_loses_no_run(
    proxy: BlackholeProxy, pg_url: str, tmp_path: Path, how: str
) -> None:
    @ironflow.function(id="two-steps", triggers=[ironflow.event("two.go")])
    async def two_steps(ctx: Any) -> Any:
        await ctx.step.run("a", lambda: 1)
        await trio.sleep(0.5)
        return await ctx.step.run("b", lambda: ctx.event.data)

    config = node_config(
        proxy.url(pg_url), tmp_path / "a", **PG_BOUNDS, drain_timeout_s=DRAIN_TIMEOUT_S, lease_expiry_s=3.0,
        heartbeat_interval_s=1.0,
    )
    node = Node(config)
    stopped = trio.Event()

    async def run_node(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await node.run(task_status=task_status)
        finally:
            stopped.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(run_node)
        worker = ironflow.StreamingWorker(node.url, [two_steps], handle_signals=False, reconnect_delay=0.2)
        await nursery.start(worker.run)
        async with httpx.AsyncClient(base_url=node.url, timeout=10.0) as http:
            run_ids = [(await emit(http, "two.go", {"i": i}))["run_ids"][0] for i in range(5)]
        await trio.sleep(0.2)  # the runs' first steps reported, their segments mid-sleep
        proxy.blackhole()
        async def marked_down() -> bool:
            return not node.store.availability.up

        await eventually(marked_down, timeout=3, message="store marked down")
        asked = time.monotonic()
        node.stop() if how == "stop" else node.request_shutdown()
        with trio.move_on_after(DRAIN_TIMEOUT_S + STOP_WITHIN_S + 10):
            await stopped.wait()
        took = time.monotonic() - asked
        bound = STOP_WITHIN_S + (DRAIN_TIMEOUT_S if how == "drain" else 0.0)
        assert stopped.is_set() and took <= bound, f"{how}: the node took {took:.2f} s to stop (bound {bound:g} s)"
        worker.stop()
        proxy.heal()

        # Another node on the database, with a worker: every run completes once.
        other: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "b", lease_expiry_s=3.0, heartbeat_interval_s=1.0)).run)
        second = ironflow.StreamingWorker(other.url, [two_steps], handle_signals=False)
        await nursery.start(second.run)
        async with httpx.AsyncClient(base_url=other.url, timeout=10.0) as http:
            for run_id in run_ids:
                detail = await wait_for_run(http, run_id, timeout=30)
                assert detail["run"]["status"] == "completed", detail["run"]
                assert detail["run"]["output"] == {"i": run_ids.index(run_id)}
                assert [st["name"] for st in detail["steps"]] == ["a", "b"]  # each recorded once
        second.stop()
        other.stop()


async def test_the_nodes_postgres_sessions_carry_every_bound(pg_url: str) -> None:
    config = node_config(pg_url, Path("/nonexistent"), **PG_BOUNDS)
    t = config.timings
    store = PostgresStore(pg_url, timings=t)
    await store.open()
    try:
        def show(tx: Tx) -> list[Any]:
            return [
                (tx.fetchone(f"SELECT setting FROM pg_settings WHERE name = '{name}'") or [None])[0]
                for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")
            ]

        assert await store._transact(show) == [
            str(round(s * 1000))
            for s in (t.pg_statement_timeout_s, t.pg_lock_timeout_s, t.pg_idle_in_transaction_timeout_s)
        ]
        params = next(a for a in store._actors if a._conn is not None)._conn.info.get_parameters()  # type: ignore[union-attr]
        assert params["tcp_user_timeout"] == str(round(t.pg_tcp_timeout_s * 1000))
        assert params["keepalives"] == "1"
    finally:
        await store.close()


async def test_a_lock_a_foreign_session_holds_is_given_up_at_the_lock_timeout_as_a_timeout(pg_url: str) -> None:
    config = node_config(pg_url, Path("/nonexistent"), **PG_BOUNDS)
    bound = config.timings.pg_lock_timeout_s
    with psycopg.connect(pg_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE held (id int PRIMARY KEY, v text)")
        setup.execute("INSERT INTO held VALUES (1, 'before')")
    store = PostgresStore(pg_url, timings=config.timings)
    await store.open()
    # An operator's session, not a node's: no idle-in-transaction bound ends it.
    with psycopg.connect(pg_url) as operator:
        operator.execute("SELECT v FROM held WHERE id = 1 FOR UPDATE")
        try:
            started = time.monotonic()
            with pytest.raises(StoreTimeout, match="pg_lock_timeout_s"):
                await store._transact(lambda tx: tx.execute("UPDATE held SET v = 'node' WHERE id = 1"))
            waited = time.monotonic() - started
            # The optimistic pass and the careful one each wait the bound once.
            assert bound - LOCK_SLACK_S <= waited <= 2 * bound + LOCK_SLACK_S, waited
            assert store.availability.up  # a timeout, not an outage
        finally:
            operator.rollback()
            await store.close()


async def test_calls_that_all_wait_on_a_lock_are_no_outage_and_a_stale_monitor_connection_is_replaced(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every connection of the node waits on a row an operator's session holds
    # (as two nodes' deadlocked group commits do until PostgreSQL breaks
    # them): the read probe queued behind them cannot answer, the database can.
    config = node_config(pg_url, Path("/nonexistent"), **PG_BOUNDS)
    timeout_s = config.timings.store_probe_timeout_s
    with psycopg.connect(pg_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE held (id int PRIMARY KEY, v text)")
        setup.execute("INSERT INTO held VALUES (1, 'before')")
    store = PostgresStore(pg_url, connections=2, timings=config.timings)
    await store.open()
    with psycopg.connect(pg_url) as operator:
        operator.execute("SELECT v FROM held WHERE id = 1 FOR UPDATE")
        try:
            async with trio.open_nursery() as waiting:
                for i in range(2):  # a group on duty, then one relieving it (postgres._Duty)
                    waiting.start_soon(_update_held, store, i)
                    await trio.sleep(0.2)
                # Both connections now wait on the row: a third call queues behind them.
                assert await store_monitor._probe(store, timeout_s, write=False)
                assert store.availability.up
                monitor = store._monitor_conn
                assert monitor is not None, "the direct probe answered on the monitor's connection"
                # That connection dies while idle (a server restart, a proxy's
                # timeout): the next direct probe makes a new one, no outage.
                operator.execute("SELECT pg_terminate_backend(%s)", (monitor.info.backend_pid,))
                assert await store_monitor._probe(store, timeout_s, write=False)
                assert store.availability.up and store._monitor_conn is not monitor
                # Without the direct probe the same wait reads as an outage.
                monkeypatch.setattr(store_monitor, "DIRECT_AFTER", 10.0)
                assert not await store_monitor._probe(store, timeout_s, write=False)
                assert not store.availability.up
                operator.rollback()
        finally:
            await store.close()


async def _update_held(store: PostgresStore, i: int) -> None:
    """A call that waits on the row ``held`` 1 until the operator lets go (or
    is answered when the store is marked down)."""
    try:
        await store._transact(lambda tx: tx.execute("UPDATE held SET v = ? WHERE id = 1", (f"node {i}",)))
    except StoreUnavailable:
        pass
