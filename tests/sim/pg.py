"""The simulator on PostgreSQL: two nodes, one real database, interleaved transactions.

The SQLite mode runs the store inline, one statement at a time, so two
transactions never interleave in it. Here every node slot has its own
:class:`~ironflow.store.postgres.PostgresStore` (its own database actor
threads and connections) on one fresh database per seed, and the
transactions of both nodes really run at once. :class:`PausingTx`, a test
subclass of the store's transaction (injected through
``PostgresStore.tx_class``, no switch in the engine), sleeps a seeded random
0–3 ms before each statement and before each COMMIT, so the transactions
interleave at every statement boundary.

Time stays virtual (``MockClock``), and the database clock follows it:

- :class:`ClockHold` stops the clock's autojump while any store call is in
  flight (a thread is working: Trio looks idle, but is not), so virtual time
  stands still while the database works, as it does for the inline SQLite
  store;
- ``ironflow_now()`` reads the setting ``ironflow.sim_now``, which
  :class:`PausingTx` sets to ``BASE + virtual time`` as each group begins
  (the engine's own definition reads ``now()``, the transaction's start:
  the same moment, or a little earlier when the last group's COMMIT began
  the transaction), and ``ironflow_clock()`` is the same (the engine's adds
  the real time since the transaction began, which is no virtual time here).

What is not exact here, unlike the SQLite mode: a seed does not replay (real
threads interleave as they do), and the oracle's reads before a call can be
overtaken by another node's commit before the call's own transaction runs;
:mod:`tests.sim.observed` judges such calls only by what no concurrent
transaction could have changed (``Oracle.concurrent``). The seed still drives
the schedule, the faults and every pause.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import trio
import trio.testing
from psycopg import sql

from ironflow.store.pg_tx import PgTx as _PgTx
from ironflow.store.postgres import PostgresStore
from tests.sim.observed import OutcomesByTask
from tests.sim.schedule import rng_for

# Longest pause (seconds) before a statement or a COMMIT: a few round trips,
# enough for another node's statement to land in between.
PAUSE_MAX_S = 0.003
# The simulator's database clock, set in each transaction (see module doc).
SIM_NOW_SETTING = "ironflow.sim_now"
SIM_NOW_FUNCTION = (
    "CREATE OR REPLACE FUNCTION ironflow_now() RETURNS double precision\n"
    "LANGUAGE sql STABLE AS $$\n"
    f"    SELECT current_setting('{SIM_NOW_SETTING}')::double precision\n"
    "$$"
)
# ``ironflow_clock()`` (the clock at this instant, not at the transaction's
# start): virtual time stands still while a transaction runs, so the same.
SIM_CLOCK_FUNCTION = (
    "CREATE OR REPLACE FUNCTION ironflow_clock() RETURNS double precision\n"
    "LANGUAGE sql VOLATILE AS $$\n"
    "    SELECT ironflow_now()\n"
    "$$"
)
# One database per campaign process holds the schema; each seed's database
# is a copy of it (CREATE DATABASE … TEMPLATE: a file copy, ~10 ms).
TEMPLATE_PREFIX = "ironflow_sim_template"

# Orders transactions across both nodes: taken as a group begins and after
# its COMMIT returned (a commit numbered before a group's begin is visible to
# every statement of that group).
_numbers = itertools.count(1)


class ClockHold:
    """Stops ``clock``'s autojump while store calls are in flight (Trio thread only).

    A *flowing* hold also lets virtual time pass at the rate of real time: for
    a wait on a thread that sleeps on Trio's clock meanwhile (the kick
    listener's start, which polls, and its stop, which its thread notices
    within ``LISTEN_POLL_S``). Without it, virtual time would leap ahead of
    every timer in the simulation while the thread works."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock
        self._held = 0
        self._flowing = 0

    def hold(self, *, flowing: bool = False) -> None:
        self._held += 1
        self._flowing += flowing
        if self._held == 1:
            self.clock.autojump_threshold = math.inf
        if flowing and self._flowing == 1:
            self.clock.rate = 1.0

    def release(self, *, flowing: bool = False) -> None:
        self._held -= 1
        self._flowing -= flowing
        if flowing and self._flowing == 0:
            self.clock.rate = 0.0
        if self._held == 0:
            self.clock.autojump_threshold = 0

    def epoch_now(self, base: float) -> float:
        """Read from a database thread: virtual time does not move while held."""
        return base + self.clock.current_time()


class Pauses:
    """Seeded pauses, one RNG per database thread of one node slot."""

    def __init__(self, seed: int, slot: int) -> None:
        self._seed = seed
        self._slot = slot
        self._local = threading.local()

    def pause(self) -> None:
        rng = getattr(self._local, "rng", None)
        if rng is None:
            rng = self._local.rng = rng_for(self._seed, "pauses", self._slot, threading.current_thread().name)
        time.sleep(rng.uniform(0.0, PAUSE_MAX_S))


class PausingTx(_PgTx):
    """The store's PostgreSQL transaction, pausing before each statement and
    COMMIT, setting the simulator's clock as its group begins, and numbering
    that begin and the COMMIT for the oracle (``on_commit``). Bound to a node slot by
    :func:`pausing_tx`."""

    pauses: Pauses
    hold: ClockHold
    base: float
    # The oracle's own reads inside a transaction go through this, unpaused.
    unpaused = _PgTx

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.begun_at = 0
        self.on_commit: list[Callable[[int], None]] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        self.pauses.pause()
        return super().execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> None:
        self.pauses.pause()
        super().executemany(sql, rows)

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        self.pauses.pause()
        return super().fetchone(sql, params)

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.pauses.pause()
        return super().fetchall(sql, params)

    def advisory_lock(self, key: str) -> None:
        self.pauses.pause()
        super().advisory_lock(key)

    def begin(self, batch: Any) -> None:
        # BEGIN and the group's named locks, if any (the BEGIN itself may have
        # come with the last group's COMMIT: _commit's ``then_begin``).
        super().begin(batch)
        now = self.hold.epoch_now(self.base)
        super().fetchone(f"SELECT set_config('{SIM_NOW_SETTING}', ?, true)", (repr(now),))
        self.begun_at = next(_numbers)
        self.on_commit = []

    def commit(self, statements: list[str]) -> None:
        self.pauses.pause()
        super().commit(statements)
        n = next(_numbers)
        for note in self.on_commit:
            note(n)
        self.on_commit = []

    def raw(self, sql: str) -> None:
        if sql == "ROLLBACK":
            self.on_commit = []
        super().raw(sql)


def pausing_tx(pauses: Pauses, hold: ClockHold, base: float) -> type[PausingTx]:
    return type("SlotTx", (PausingTx,), {"pauses": pauses, "hold": hold, "base": base})


class SimPostgresStore(OutcomesByTask, PostgresStore):
    """A node slot's store: the real one, its calls holding the virtual clock
    while in flight, its transactions pausing (:class:`PausingTx`)."""

    hold: ClockHold

    def __init__(self, url: str, *, hold: ClockHold, pauses: Pauses, base: float) -> None:
        super().__init__(url)
        self.hold = hold
        self.tx_class = pausing_tx(pauses, hold, base)

    async def open(self) -> None:
        self.hold.hold()
        try:
            await super().open()
        finally:
            self.hold.release()

    async def watch_kicks(
        self, on_kick: Callable[[], None], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The store's, with the clock held (flowing) while its listener thread
        starts and while it stops (see :class:`ClockHold`)."""
        holds = 0

        def hold() -> None:
            nonlocal holds
            holds += 1
            self.hold.hold(flowing=True)

        def release() -> None:
            nonlocal holds
            holds -= 1
            self.hold.release(flowing=True)

        class Started:
            done = False

            def started(self, value: None = None) -> None:
                if not self.done:
                    self.done = True
                    release()
                task_status.started(value)

        async def hold_once_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                hold()

        hold()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold_once_cancelled)
                await super().watch_kicks(on_kick, task_status=Started())  # type: ignore[arg-type]
        finally:
            while holds:
                release()

    async def _transact(self, work: Callable[[Any], Any], *locks: Any, **kwargs: Any) -> Any:
        self.hold.hold()
        try:
            return await super()._transact(work, *locks, **kwargs)
        finally:
            self.hold.release()

    async def _transact_many(self, works: list[Any]) -> Any:
        self.hold.hold()
        try:
            return await super()._transact_many(works)
        finally:
            self.hold.release()


class PgReader:
    """The oracle's read-only view of the seed's database (``?`` placeholders)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)

    def one(self, query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        return self.conn.execute(_pg(query), params).fetchone()

    def all(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(_pg(query), params).fetchall()

    def close(self) -> None:
        self.conn.close()


def _pg(query: str) -> str:
    return query.replace("%", "%%").replace("?", "%s")


class SimDatabases:
    """Fresh databases on one PostgreSQL server, copied from a schema template."""

    def __init__(self, server_url: str) -> None:
        self.server = server_url.rstrip("/")
        self.template = ""

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(f"{self.server}/postgres", autocommit=True)

    def _make_template(self) -> None:
        import os

        name = f"{TEMPLATE_PREFIX}_{os.getpid()}_{os.urandom(3).hex()}"
        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        url = f"{self.server}/{name}"

        async def schema() -> None:
            store = PostgresStore(url, connections=1)
            await store.open()
            await store.close()

        trio.run(schema)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SIM_NOW_FUNCTION)
            conn.execute(SIM_CLOCK_FUNCTION)
        self.template = name

    def create(self, seed: int) -> str:
        """A new database for ``seed``, with the schema and the simulator's clock."""
        import os

        if not self.template:
            self._make_template()
        name = f"sim_{seed}_{os.urandom(3).hex()}"
        with self._admin() as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(self.template))
            )
        return f"{self.server}/{name}"

    def drop(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def close(self) -> None:
        if self.template:
            with self._admin() as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.template)))
            self.template = ""
