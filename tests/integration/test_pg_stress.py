"""Two nodes over one PostgreSQL, driven through the HTTP API at full rate as a
user would: the stress proofs of docs/isolation.md's races.

Each test starts two ``ironflow serve`` processes on one database and one
``tests/procs/race_worker.py`` on each, and drives them with many concurrent
HTTP requests spread over both nodes:

- every wait receives the matching event emitted after its run began (race 2
  and race 3: before the fix 179–229 of 500 waits were lost);
- a cancel at a run's last step ends the run once, its answer agrees with the
  end, and no step row commits after the cancel (race 5);
- two nodes emitting idempotency keys in opposite orders, beside parked waits
  and concurrency-limited runs, never deadlock, expire nothing and run no step
  body twice (race 6).

The PostgreSQL cluster is this module's own (``track_commit_timestamp`` on,
its server log read for deadlocks) unless ``IRONFLOW_TEST_PG_URL`` names one.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import trio

from ironflow.testing import ThrowawayPostgres
from tests.integration.helpers import eventually
from tests.integration.procs import Proc, free_port, start_node, start_race_worker

pytestmark = pytest.mark.slow

# Commit timestamps date each step row against its run's cancel (test 2); the
# server log is where PostgreSQL reports a deadlock it broke (test 3).
STRESS_PG_OPTIONS = "-c track_commit_timestamp=on"
# Concurrent HTTP requests, spread over both nodes: the 48 clients.
CLIENTS = 48
# How often the marks file is read for runs that have begun.
TAIL_INTERVAL_S = 0.005
# How often the database is read while waiting for runs to settle.
POLL_INTERVAL_S = 0.25
# Every wait outlives the test: a wait still parked after its event was
# acknowledged is lost, never timed out.
WAIT_TIMEOUT_S = 300.0
# Bounds on a failure, not timing guesses: the work takes a fraction of these.
DRIVE_TIMEOUT_S = 90.0
SETTLE_TIMEOUT_S = 60.0
TERMINAL = frozenset({"completed", "failed", "cancelled"})

# Test 1: runs each waiting for its own key, and as many events no run waits on.
RACE_RUNS = 500
# Test 2: runs cancelled at their last step; the last step body pauses up to
# this long after its mark, so the cancel lands before or after the run ends.
CANCEL_RUNS = 300
LAST_STEP_JITTER_S = 0.5
# Test 3: idempotency keys emitted by each node, in opposite orders; parked
# waits on the emitted name that its events resolve, and some they never do.
KEYS = 1000
# Keys emitted by both nodes at once before the next block: a block is where
# the two orders cross, and small enough that the groups in flight on each
# node hold keys the other node's groups want.
KEY_BLOCK = 50
# Events per POST /v1/events/batch: one transaction, its keys locked together.
EMIT_BATCH = 5
PARKED_MATCHED = 100
PARKED_UNMATCHED = 20
# Node log lines that say a reservation, a session or a lease expired.
EXPIRY_LINES = (
    "capacity: reservations expired",
    "capacity: worker sessions expired",
    "capacity: lease expired",
)


# ── the cluster ────────────────────────────────────────────────────────────


@dataclass
class StressServer:
    url: str  # no database part
    log: Path | None  # the server log, when the cluster is ours


@pytest.fixture(scope="module")
def stress_server() -> Iterator[StressServer]:
    existing = os.environ.get("IRONFLOW_TEST_PG_URL")
    if existing:
        yield StressServer(existing.rstrip("/"), None)
        return
    pg = ThrowawayPostgres(server_options=STRESS_PG_OPTIONS)
    error = ""
    try:
        url = pg.start()
    except RuntimeError as e:  # no server binaries: FAIL, never skip
        error = f"{e} Or set IRONFLOW_TEST_PG_URL to an existing server."
    if error:
        pytest.fail(error, pytrace=False)
    try:
        yield StressServer(url, Path(pg.base_dir) / "log")
    finally:
        pg.stop()


@pytest.fixture
def stress_db(stress_server: StressServer) -> Iterator[str]:
    url = ThrowawayPostgres(stress_server.url).new_database("stress")
    yield url
    with psycopg.connect(f"{stress_server.url}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def _query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return list(conn.execute(sql, params).fetchall())


async def query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of one query straight from the database, off the Trio thread."""
    return await trio.to_thread.run_sync(_query, url, sql, params)


@dataclass
class Cluster:
    db: str
    urls: list[str]  # node-a, node-b
    nodes: list[Proc]
    workers: list[Proc]  # workers[i] is connected to urls[i]
    effects: Path

    def node_of_worker(self, pid: int) -> int:
        return next(i for i, w in enumerate(self.workers) if w.pid == pid)


async def two_nodes(db: str, tmp_path: Path, procs: list[Proc]) -> Cluster:
    """Two node processes on ``db`` and a race worker on each."""
    urls, nodes, workers = [], [], []
    effects = tmp_path / "effects"
    for name in ("node-a", "node-b"):
        port = free_port()
        node = await start_node(db, tmp_path / name, tmp_path, node_id=name, port=port)
        procs.append(node)
        nodes.append(node)
        urls.append(f"http://127.0.0.1:{port}")
    for i, url in enumerate(urls):
        workers.append(await start_race_worker(procs, url, effects, tmp_path, f"worker-{i}"))
    return Cluster(db, urls, nodes, workers, effects)


class Marks:
    """The race workers' marks file, read on: the rows appended since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new(self) -> list[tuple[float, str, str, int]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        rows = []
        for line in lines:
            t, run_id, what, pid = line.decode().split()
            rows.append((float(t), run_id, what, int(pid)))
        return rows


@dataclass
class Driver:
    """``CLIENTS`` concurrent requests over both nodes, taken from one channel of
    ``(node index or None, method path, body, on_answer)``: None alternates."""

    urls: list[str]
    failures: list[str] = field(default_factory=list)

    async def serve(
        self, receive: trio.MemoryReceiveChannel[Any], *, clients: int = CLIENTS
    ) -> None:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as http:

            async def client(i: int) -> None:
                turn = i
                async for node, path, body, on_answer in receive:
                    turn += 1
                    url = self.urls[turn % len(self.urls) if node is None else node]
                    sent = time.time()
                    resp = await http.post(url + path, json=body)
                    if resp.status_code >= 500:
                        self.failures.append(f"{path} {body}: {resp.status_code} {resp.text[:200]}")
                    if on_answer is not None:
                        await on_answer(http, url, resp, sent)

            async with trio.open_nursery() as nursery:
                for i in range(clients):
                    nursery.start_soon(client, i)


def emitted(failures: list[str], sink: dict[str, Any] | None = None, key: str = "") -> Callable[..., Awaitable[None]]:
    """An ``on_answer`` for an emit: a refusal is a failure; ``sink[key]`` gets
    ``(answer, time sent)``."""

    async def on_answer(_: httpx.AsyncClient, url: str, resp: httpx.Response, sent: float) -> None:
        if resp.status_code not in (200, 201):
            failures.append(f"emit on {url}: {resp.status_code} {resp.text[:200]}")
        elif sink is not None:
            sink[key] = (resp.json(), sent)

    return on_answer


def node_log_lines(cluster: Cluster, needles: tuple[str, ...]) -> list[str]:
    return [
        line
        for node in cluster.nodes
        for line in node.log_path.read_text(errors="replace").splitlines()
        if any(n in line for n in needles)
    ]


def p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


# ── 1. waits ───────────────────────────────────────────────────────────────


async def test_every_wait_receives_its_event_emitted_after_its_run_began_on_two_nodes(
    stress_db: str, tmp_path: Path, procs: list[Proc]
) -> None:
    cluster = await two_nodes(stress_db, tmp_path, procs)
    driver = Driver(cluster.urls)
    marks = Marks(cluster.effects)
    keys = [f"k{i}" for i in range(RACE_RUNS)]
    starts: dict[str, Any] = {}
    goes: dict[str, Any] = {}
    begun_at: dict[str, float] = {}
    send, receive = trio.open_memory_channel[Any](0)

    async def start_runs(send: trio.MemorySendChannel[Any]) -> None:
        async with send:
            for i, key in enumerate(keys):
                body = {"name": "race.start", "data": {"k": key, "timeout": WAIT_TIMEOUT_S}}
                await send.send((None, "/v1/events", body, emitted(driver.failures, starts, key)))
                other = {"name": "race.go", "data": {"k": f"other{i}"}}  # no run waits on it
                await send.send((None, "/v1/events", other, emitted(driver.failures)))

    async def go_once_started(send: trio.MemorySendChannel[Any]) -> None:
        # A run's event as soon as its step ran (the worker starts the handler
        # once it has the assignment, maybe before its JobAck commits): the
        # look-back rule says the wait parked by that segment must receive it.
        async with send, httpx.AsyncClient(timeout=30.0) as http, trio.open_nursery() as nursery:
            begun: set[str] = set()
            while len(begun) < len(keys):
                for t, run_id, what, _ in marks.new():
                    key = what.removeprefix("begin:")
                    if what.startswith("begin:") and key not in begun:
                        begun.add(key)
                        begun_at[key] = t
                        nursery.start_soon(go_when_started, http, run_id, key, send.clone())
                await trio.sleep(TAIL_INTERVAL_S)

    async def go_when_started(
        http: httpx.AsyncClient, run_id: str, key: str, send: trio.MemorySendChannel[Any]
    ) -> None:
        async with send:
            body = {"name": "race.go", "data": {"k": key}}
            await send.send((None, "/v1/events", body, emitted(driver.failures, goes, key)))

    t0 = time.time()
    with trio.fail_after(DRIVE_TIMEOUT_S):
        async with trio.open_nursery() as nursery, send:
            nursery.start_soon(start_runs, send.clone())
            nursery.start_soon(go_once_started, send.clone())
            nursery.start_soon(driver.serve, receive)
    driven = time.time() - t0
    assert driver.failures == []
    run_of = {key: answer["run_ids"][0] for key, (answer, _) in starts.items()}
    assert len(run_of) == RACE_RUNS and len(goes) == RACE_RUNS

    async def settled() -> list[tuple[Any, ...]] | None:
        # Once its event was acknowledged a wait is resolved, or it never will
        # be (the ingest committed without it): lost. Settled when every run
        # completed or is so lost.
        rows = await query(
            stress_db,
            "SELECT r.id, r.status, r.output, r.ended_at, s.status FROM runs r"
            " LEFT JOIN steps s ON s.run_id = r.id AND s.name = 'go' WHERE r.function_id = 'racer'",
        )
        done = len(rows) == RACE_RUNS and all(
            status in TERMINAL or step in ("waiting", "timed_out") for _, status, _, _, step in rows
        )
        return rows if done else None

    rows = await eventually(settled, timeout=SETTLE_TIMEOUT_S, interval=POLL_INTERVAL_S,
                            message="every run completed or its wait lost")
    by_run = {row[0]: row for row in rows}
    lost = [
        (key, by_run[run_id][1], by_run[run_id][4])
        for key, run_id in run_of.items()
        if by_run[run_id][1] != "completed" or json.loads(by_run[run_id][2]) ["k"] != key
    ]
    ended = [r[3] for r in rows if r[3] is not None]
    go_to_completed = [by_run[run_of[k]][3] - goes[k][1] for k in keys if by_run[run_of[k]][3] is not None]
    print(
        f"\nwaits: {len(lost)} of {RACE_RUNS} lost; {RACE_RUNS} runs + {RACE_RUNS} other events"
        f" driven in {driven:.1f}s, all ended {max(ended) - t0:.1f}s after the first start;"
        f" go→completed p50 {p50_ms(go_to_completed):.0f} ms,"
        f" p99 {1000 * sorted(go_to_completed)[int(0.99 * len(go_to_completed))]:.0f} ms"
    )
    stories = [await wait_story(stress_db, run_of[key], key, goes[key][1], begun_at[key]) for key, *_ in lost[:10]]
    assert lost == [], f"{len(lost)} of {RACE_RUNS} waits lost:\n" + "\n".join(stories)


async def wait_story(db: str, run_id: str, key: str, go_sent: float, begun: float) -> str:
    """What the database says of a lost wait: when its run's segment was
    activated, its wait parked, its event committed (commit timestamps)."""
    commit = "extract(epoch FROM pg_xact_commit_timestamp({}.xmin))"
    started = await query(
        db, f"SELECT at, {commit.format('a')} FROM audit_log a WHERE run_id = %s AND type = 'run.started'",
        (run_id,),
    )
    steps = await query(
        db, f"SELECT name, status, execution_seq, created_at, {commit.format('s')} FROM steps s"
        " WHERE run_id = %s ORDER BY seq", (run_id,),
    )
    event = await query(
        db, f"SELECT received_at, xid, {commit.format('e')} FROM events e WHERE name = 'race.go'"
        " AND data::jsonb ->> 'k' = %s", (key,),
    )
    trail = await query(db, "SELECT type FROM audit_log WHERE run_id = %s ORDER BY at", (run_id,))
    return (
        f"{run_id} {key}: begin mark {begun:.4f}, go sent {go_sent:.4f}; run.started (at, commit)"
        f" {started}; go event (received_at, xid, commit) {event}; steps {steps}; trail {[t for t, in trail]}"
    )


# ── 2. cancels at the last step ────────────────────────────────────────────


async def test_a_cancel_at_the_last_step_ends_the_run_once_and_no_step_commits_after_it(
    stress_db: str, tmp_path: Path, procs: list[Proc]
) -> None:
    cluster = await two_nodes(stress_db, tmp_path, procs)
    driver = Driver(cluster.urls)
    marks = Marks(cluster.effects)
    started: dict[str, Any] = {}
    # run id → (cancel status code, the run's steps read right after a 200)
    cancels: dict[str, tuple[int, dict[str, str] | None]] = {}
    marked: dict[str, float] = {}  # run id → its last step's mark
    answered: dict[str, float] = {}  # run id → mark → its cancel's answer
    send, receive = trio.open_memory_channel[Any](0)

    async def start_runs(send: trio.MemorySendChannel[Any]) -> None:
        async with send:
            for i in range(CANCEL_RUNS):
                body = {"name": "last.start", "data": {"jitter": LAST_STEP_JITTER_S}}
                await send.send((None, "/v1/events", body, emitted(driver.failures, started, str(i))))

    async def cancelled(http: httpx.AsyncClient, url: str, resp: httpx.Response, _: float) -> None:
        run_id = resp.request.url.path.split("/")[-2]
        answered[run_id] = time.time() - marked[run_id]
        seen = None
        if resp.status_code == 200:
            # Read at once, after the cancel committed: what the run's history is.
            got = await http.get(f"{url}/v1/runs/{run_id}")
            assert got.status_code == 200, (got.status_code, got.text[:500])
            detail = got.json()
            seen = {s["step_id"]: s["status"] for s in detail["steps"]}
            seen["(run)"] = detail["run"]["status"]
        cancels[run_id] = (resp.status_code, seen)

    async def cancel_at_last_step() -> None:
        # On the last step's mark, cancel at once (not queued behind the
        # starts) through the node its worker is not on.
        async with httpx.AsyncClient(timeout=30.0) as http, trio.open_nursery() as nursery:
            asked = 0
            while asked < CANCEL_RUNS:
                for t, run_id, what, pid in marks.new():
                    if what == "last":
                        asked += 1
                        marked[run_id] = t
                        url = cluster.urls[1 - cluster.node_of_worker(pid)]
                        nursery.start_soon(cancel, http, url, run_id)
                await trio.sleep(TAIL_INTERVAL_S)

    async def cancel(http: httpx.AsyncClient, url: str, run_id: str) -> None:
        resp = await http.post(f"{url}/v1/runs/{run_id}/cancel", json={})
        await cancelled(http, url, resp, 0.0)

    t0 = time.time()
    with trio.fail_after(DRIVE_TIMEOUT_S):
        async with trio.open_nursery() as nursery, send:
            nursery.start_soon(start_runs, send.clone())
            nursery.start_soon(cancel_at_last_step)
            nursery.start_soon(driver.serve, receive)
    driven = time.time() - t0
    assert driver.failures == []
    assert len(cancels) == CANCEL_RUNS

    async def ended() -> list[tuple[Any, ...]] | None:
        rows = await query(stress_db, "SELECT id, status FROM runs WHERE function_id = 'lastcall'")
        return rows if len(rows) == CANCEL_RUNS and all(s in TERMINAL for _, s in rows) else None

    final = dict(await eventually(ended, timeout=SETTLE_TIMEOUT_S, interval=POLL_INTERVAL_S,
                                  message="every run ended"))
    ends = Counter(
        run_id for run_id, in await query(
            stress_db, "SELECT run_id FROM audit_log WHERE type IN"
            " ('run.completed', 'run.cancelled', 'run.failed')",
        )
    )
    steps: dict[str, dict[str, str]] = defaultdict(dict)
    for run_id, step_id, status in await query(stress_db, "SELECT run_id, step_id, status FROM steps"):
        steps[run_id][step_id] = status
    codes = Counter(code for code, _ in cancels.values())
    disagree = [
        (run_id, code, final[run_id]) for run_id, (code, _) in cancels.items()
        if (code, final[run_id]) not in ((200, "cancelled"), (409, "completed"))
    ]
    changed = [
        (run_id, seen, {**steps[run_id], "(run)": final[run_id]})
        for run_id, (code, seen) in cancels.items()
        if code == 200 and seen != {**steps[run_id], "(run)": final[run_id]}
    ]
    # By commit order: a step row of a cancelled run committed after the
    # transaction that cancelled it (its run.cancelled audit row).
    late = await query(
        stress_db,
        "SELECT s.run_id, s.step_id FROM steps s JOIN audit_log a ON a.run_id = s.run_id"
        " AND a.type = 'run.cancelled' WHERE pg_xact_commit_timestamp(s.xmin)"
        " > pg_xact_commit_timestamp(a.xmin)",
    ) if await commit_timestamps(stress_db) else []
    at_the_end = sum(1 for run_id, (code, _) in cancels.items() if code == 200 and "last" in steps[run_id])
    print(
        f"\ncancels: {CANCEL_RUNS} runs in {driven:.1f}s; answers {dict(codes)}; {at_the_end}"
        f" cancelled with their last step recorded; {len(changed)} histories changed after"
        f" the cancel's 200, {len(late)} step rows committed after their run's cancel;"
        f" last step's mark → cancel answered p50 {p50_ms(list(answered.values())):.0f} ms"
    )
    assert sorted(Counter(final.values())) in (["cancelled"], ["cancelled", "completed"], ["completed"])
    assert [r for r in final if ends[r] != 1] == [], "a run ended other than exactly once"
    assert disagree == [], f"cancel answers that disagree with the run's end: {disagree[:10]}"
    assert changed == [], f"histories changed after the cancel's 200: {changed[:5]}"
    assert late == [], f"step rows committed after their run's cancel: {late[:10]}"


async def commit_timestamps(db: str) -> bool:
    """Whether the server records commit timestamps (this module's own cluster does)."""
    return (await query(db, "SELECT current_setting('track_commit_timestamp')"))[0][0] == "on"


# ── 3. no deadlocks ────────────────────────────────────────────────────────


async def deadlocks(db: str) -> int:
    rows = await query(db, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    return int(rows[0][0])


async def test_two_nodes_emitting_keys_in_opposite_orders_beside_waits_and_limits_never_deadlock(
    stress_db: str, stress_server: StressServer, tmp_path: Path, procs: list[Proc]
) -> None:
    log_from = stress_server.log.stat().st_size if stress_server.log else 0
    cluster = await two_nodes(stress_db, tmp_path, procs)
    driver = Driver(cluster.urls)
    keys = [f"K{i}" for i in range(KEYS)]
    # Parked waits on the name the storm emits: some its events resolve, some never.
    matched = keys[:: KEYS // PARKED_MATCHED]
    parked = {k: "" for k in [*matched, *(f"Z{j}" for j in range(PARKED_UNMATCHED))]}
    async with httpx.AsyncClient(timeout=30.0) as http:
        for i, key in enumerate(parked):
            body = {"name": "dl.park", "data": {"k": key, "timeout": WAIT_TIMEOUT_S}}
            parked[key] = (await http.post(cluster.urls[i % 2] + "/v1/events", json=body)).json()["run_ids"][0]

    async def all_parked() -> bool:
        rows = await query(stress_db, "SELECT count(*) FROM steps WHERE name = 'k' AND status = 'waiting'")
        return rows[0][0] == len(parked)

    await eventually(all_parked, timeout=SETTLE_TIMEOUT_S, message="every dl.park wait parked")
    before = await deadlocks(stress_db)
    answers: dict[str, Any] = {}

    async def emit_in_order(http: httpx.AsyncClient, node: int, order: list[str]) -> None:
        # CLIENTS // 2 batches in flight on the node, taken in ``order``.
        pending = iter([order[i:i + EMIT_BATCH] for i in range(0, len(order), EMIT_BATCH)])

        async def client() -> None:
            for batch in pending:
                body = {"events": [
                    {"name": "dl.go", "data": {"k": key}, "idempotency_key": key} for key in batch
                ]}
                resp = await http.post(cluster.urls[node] + "/v1/events/batch", json=body)
                if resp.status_code not in (200, 201):
                    driver.failures.append(f"batch on node {node}: {resp.status_code} {resp.text[:200]}")
                    continue
                for key, answer in zip(batch, resp.json()["events"], strict=True):
                    answers[f"{node}{key}"] = answer

        async with trio.open_nursery() as nursery:
            for _ in range(CLIENTS // 2):
                nursery.start_soon(client)

    t0 = time.time()
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    with trio.fail_after(DRIVE_TIMEOUT_S):
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as http:
            # Block by block, both nodes at once: node a ascending, node b
            # descending, so their groups meet on the same keys in opposite
            # orders once per block.
            for first in range(0, KEYS, KEY_BLOCK):
                block = keys[first:first + KEY_BLOCK]
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(emit_in_order, http, 0, block)
                    nursery.start_soon(emit_in_order, http, 1, block[::-1])
    driven = time.time() - t0
    assert driver.failures == []
    assert len(answers) == 2 * KEYS
    twice = [k for k in keys if answers[f"0{k}"]["event_id"] != answers[f"1{k}"]["event_id"]]
    assert twice == [], f"keys emitted on both nodes stored as two events: {twice[:10]}"

    async def done() -> bool:
        rows = await query(
            stress_db, "SELECT count(*) FILTER (WHERE function_id = 'tally'),"
            " count(*) FILTER (WHERE function_id = 'parker') FROM runs WHERE status = 'completed'",
        )
        return rows[0] == (KEYS, len(matched))

    unfinished = ""  # the figures below are read either way: they say why
    try:
        await eventually(done, timeout=SETTLE_TIMEOUT_S, interval=POLL_INTERVAL_S,
                         message=f"{KEYS} tally and {len(matched)} parker runs completed")
    except AssertionError as e:
        unfinished = str(e)
    took = time.time() - t0
    # While the workers are still connected: nothing expired, nothing refused as stale.
    expired = node_log_lines(cluster, EXPIRY_LINES)
    stale = 0.0
    async with httpx.AsyncClient(timeout=10.0) as http:
        for url in cluster.urls:
            for line in (await http.get(url + "/metrics")).text.splitlines():
                if line.startswith("ironflow_stale_messages_total "):
                    stale += float(line.split()[1])
    recovered = await query(
        stress_db, "SELECT run_id, type FROM audit_log WHERE type IN"
        " ('capacity.lease.expired', 'capacity.segment.recovered', 'capacity.job.nacked')",
    )
    starts = Counter(
        (run_id, what) for _, run_id, what, _ in Marks(cluster.effects).new()
        if what in ("count-start", "after")
    )
    recovered_runs = {run_id for run_id, _ in recovered}
    twice_run = [(r, w, n) for (r, w), n in starts.items() if n > 1 and r not in recovered_runs]
    resolved = dict(await query(
        stress_db, "SELECT id, output FROM runs WHERE function_id = 'parker' AND status = 'completed'"
    ))
    wrong = [k for k in matched if json.loads(resolved.get(parked[k], "{}")).get("k") != k]
    # The nodes' connections close with them: each backend flushes its
    # statistics (deadlocks counted by the one that broke it) as it exits.
    for proc in [*cluster.workers, *cluster.nodes]:
        proc.stop()

    async def backends_gone() -> bool:
        rows = await query(
            stress_db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()",
        )
        return rows[0][0] == 0

    await eventually(backends_gone, timeout=30.0, message="the nodes' database sessions closed")
    await query(stress_db, "SELECT pg_stat_force_next_flush()")
    found = await deadlocks(stress_db) - before
    logged: list[str] = []
    if stress_server.log is not None:
        with stress_server.log.open("rb") as f:
            f.seek(log_from)
            lines = f.read().decode(errors="replace").splitlines()
        # The report's own lines follow the ERROR: its backend's DETAIL (who
        # waited on what, both statements), HINT, CONTEXT, STATEMENT.
        for i, line in enumerate(lines):
            if "deadlock detected" in line:
                logged.append(line)
                pid = line.split("]", 1)[0].rsplit("[", 1)[-1]
                for follow in lines[i + 1:i + 40]:
                    if follow[:4].isdigit() and f"[{pid}]" not in follow:
                        break
                    print(follow)
    print(
        f"\ndeadlocks: {found} (pg_stat_database), {len(logged)} in the server log;"
        f" {2 * KEYS} emits of {KEYS} keys in {driven:.1f}s, {KEYS} tally + {len(matched)}"
        f" resolved parker runs done in {took:.1f}s; {len(expired)} expiries logged,"
        f" {stale:.0f} stale messages, {len(recovered)} lease expiries/recoveries/nacks audited,"
        f" {len(twice_run)} bodies run twice unexplained"
        + (f"; {unfinished}" if unfinished else "")
    )
    assert found == 0 and logged == [], f"{found} deadlocks: {logged[:5]}"
    assert unfinished == ""
    assert expired == [], f"expiries logged by the nodes: {expired[:5]}"
    assert stale == 0, f"{stale:.0f} messages refused as stale"
    assert twice_run == [], f"step bodies run twice with no recovery recorded: {twice_run[:10]}"
    assert len(starts) == KEYS + len(matched)
    assert wrong == [], f"parked waits resolved by another key's event: {wrong[:10]}"
