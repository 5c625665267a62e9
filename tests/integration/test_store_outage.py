"""The database goes away under load, and comes back: real processes, both backends.

PostgreSQL is stopped (``pg_ctl stop -m immediate``, and ``-m fast``) for
~10 s while 600 emits arrive at 80/s, each retried with its idempotency key
until acknowledged; SQLite's state directory is a small tmpfs that fills up.
What must hold (docs/operations.md, database outages):

- every emit is answered within 5 s, with 503 ``STORE_UNAVAILABLE`` (507
  ``STORAGE_FULL`` for the full disk) and a ``Retry-After`` — never a 500;
- ``/readyz`` is 503 during the outage and 200 within ~1 s after it;
- no actor crash-loops (no ``actor: crashed`` line), one ``store:
  unavailable`` line and one ``store: available again`` line;
- the worker processes are never restarted and never lose their socket;
- no lease expires and no run is recovered because of the outage (audit
  trail, recovery counts), and a step that ran across the outage ran once;
- every acknowledged event's run completes, with one row per step.

The time from the database's return to the first completed run and to the
drained backlog is printed (``-s``) for docs/benchmarks.md.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trio

from ironflow.testing import ThrowawayPostgres
from tests.integration.procs import (
    Proc,
    db_rows,
    free_port,
    read_effects,
    start_load_worker,
    start_node,
    start_worker,
    wait_effect,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]

EVENTS = 600
RATE_PER_S = 80.0
OUTAGE_S = 10.0
# Every answer during the outage must come within this.
ANSWER_WITHIN_S = 5.0
# /readyz must change within this of the outage's start and end (plus one poll).
READY_WITHIN_S = 1.0
READY_POLL_S = 0.05
# The slow step that spans the outage: longer than the outage and the --dev
# lease (6 s) together, so only a given-back lease keeps it from recovery.
SLOW_STEP_S = OUTAGE_S + 4.0
# The emitter's longest wait between two tries of one emit.
RETRY_MAX_S = 4.0


class Emitter:
    """Emits ``EVENTS`` load events at ``RATE_PER_S``, each retried with its
    idempotency key until acknowledged; records every answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, int, float, str | None, str]] = []  # at, status, took, retry-after, code
        self.acked: dict[int, str] = {}

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {"name": "load.go", "data": {"i": i}, "idempotency_key": f"outage-{i}"}
        attempt = 0
        while True:
            started = time.monotonic()
            r = await client.post("/v1/events", json=body)
            took = time.monotonic() - started
            code = r.json().get("code", "") if r.status_code >= 300 else ""
            self.answers.append((time.time(), r.status_code, took, r.headers.get("retry-after"), code))
            if r.status_code < 300:
                self.acked[i] = r.json()["run_ids"][0]
                return
            # As a client should (the SDK does): at least Retry-After, backing
            # off to RETRY_MAX_S, with jitter so retries do not come in waves.
            attempt += 1
            delay = max(float(r.headers.get("retry-after") or 0), min(2.0 ** (attempt - 1), RETRY_MAX_S))
            await trio.sleep(delay * random.uniform(1.0, 1.25))

    async def run(self) -> None:
        # No pool limit: a request waiting for a pooled connection would count
        # the client's queue as the node's answer time.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.url, timeout=30.0, limits=limits) as client:
            async with trio.open_nursery() as nursery:
                for i in range(EVENTS):
                    nursery.start_soon(self.one, client, i)
                    await trio.sleep(1 / RATE_PER_S)


class ReadyProbe:
    """Polls /readyz; keeps (sent, answered, status) of every request.

    Readiness is judged by when a request was *sent*: a node busy with the
    backlog of a recovery answers late, but the answer tells its state at the
    time it handled the request, which is after it was sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[float, float, int]] = []

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10.0) as client:
            while True:
                sent = time.time()
                r = await client.get("/readyz")
                self.seen.append((sent, time.time(), r.status_code))
                await trio.sleep(READY_POLL_S)

    def first_sent(self, status: int, after: float) -> float:
        """When the first request sent after ``after`` that got ``status`` was sent."""
        return next(sent for sent, _, s in self.seen if sent >= after and s == status)

    def statuses(self, start: float, end: float) -> set[int]:
        """Statuses of the requests sent between ``start`` and ``end``."""
        return {s for sent, _, s in self.seen if start <= sent <= end}

    def slowest_answer(self) -> float:
        return max(answered - sent for sent, answered, _ in self.seen)


def _check_answers(emitter: Emitter, outage_code: str, down_at: float, back_at: float) -> None:
    """No 500; every refusal an outage answer with Retry-After; every emit
    asked during the outage answered within ANSWER_WITHIN_S; all acknowledged."""
    statuses = {s for _, s, _, _, _ in emitter.answers}
    assert 500 not in statuses, "an emit was answered 500 during the outage"
    refused = [a for a in emitter.answers if a[1] >= 300]
    assert refused, "no emit met the outage: the test did not test it"
    assert {a[1] for a in refused} == {503 if outage_code == "STORE_UNAVAILABLE" else 507}
    assert {a[4] for a in refused} == {outage_code}
    assert all(a[3] is not None for a in refused), "an outage answer without Retry-After"
    slow = [(round(at - took - down_at, 1), status, round(took, 1))
            for at, status, took, _, _ in emitter.answers
            if down_at <= at - took <= back_at and took > ANSWER_WITHIN_S]
    if os.environ.get("OUTAGE_DEBUG"):
        for at, status, took, _, _ in sorted(emitter.answers, key=lambda a: a[0] - a[2]):
            if 7 <= at - took - down_at <= 12:
                print(f"asked {at - took - down_at:6.2f} answered {at - down_at:6.2f} {status}")
    assert not slow, f"emits asked during the outage answered after {ANSWER_WITHIN_S} s: {slow[:10]}"
    assert len(emitter.acked) == EVENTS


def _check_node_log(node: Proc, *, flaps: int = 0) -> None:
    """No crash, no internal error; one outage logged down and up. ``flaps``:
    extra down/up pairs allowed, each under 1 s — a nearly full disk: the
    failed write's rollback frees a page, the write probe fits in it, and the
    next real write fails again (docs/operations.md, "A nearly full disk")."""
    text = node.log_path.read_text(errors="replace")
    assert "actor: crashed" not in text, node.tail(60)
    downs = text.count("store: unavailable")
    assert 1 <= downs <= 1 + flaps, node.tail(60)
    assert text.count("store: available again") == downs, node.tail(60)
    outages = sorted(float(d) for d in re.findall(r"down_s=([0-9.]+)", text))
    assert all(d < 1.0 for d in outages[:-1]), node.tail(60)
    assert "api: internal error" not in text, node.tail(60)


def _check_runs(db: str, emitter: Emitter, slow_run: str, effects: Path) -> tuple[float, float]:
    """Every run completed once, nothing recovered; (first, last) end time."""
    ids = list(emitter.acked.values())
    rows = db_rows(db, "SELECT id, status, recovery_count, ended_at FROM runs")
    by_id = {r[0]: r for r in rows}
    assert all(by_id[i][1] == "completed" for i in ids), "an acknowledged run did not complete"
    assert all(r[2] == 0 for r in rows), "a run was recovered"
    steps = db_rows(db, "SELECT run_id, count(*) FROM steps GROUP BY run_id")
    assert all(n == 3 for run_id, n in steps if run_id in set(ids))
    expired = db_rows(
        db, "SELECT count(*) FROM audit_log WHERE type IN"
        " ('capacity.lease.expired', 'capacity.segment.recovered')",
    )
    assert expired[0][0] == 0, "a lease expired because of the outage"
    assert by_id[slow_run][1] == "completed"
    starts = [r for r in read_effects(effects) if r[1] == slow_run and r[2] == "two-start"]
    assert len(starts) == 1, "the step that spanned the outage ran twice"
    ends = sorted(by_id[i][3] for i in ids)
    return ends[0], ends[-1]


async def _poll_done(db: str, n: int, timeout: float) -> None:
    with trio.fail_after(timeout):
        while True:
            done = await trio.to_thread.run_sync(
                db_rows, db, "SELECT count(*) FROM runs WHERE status = 'completed'"
            )
            if done[0][0] >= n:
                return
            await trio.sleep(0.2)


def _report(
    backend: str, emitter: Emitter, back_at: float, last_end: float, ends: list[float],
    ready: ReadyProbe,
) -> None:
    first = min(e for e in ends if e >= back_at) - back_at
    after = [took for at, _, took, _, _ in emitter.answers if at - took >= back_at]
    print(
        f"\nOUTAGE {backend}: database back -> first completed run {first:.2f} s,"
        f" backlog of {EVENTS} runs drained {last_end - back_at:.2f} s;"
        f" slowest emit answer after it {max(after, default=0):.2f} s;"
        f" readyz 200 for requests sent {ready.first_sent(200, back_at) - back_at:.2f} s after it,"
        f" slowest readyz answer {ready.slowest_answer():.2f} s"
    )


@pytest.mark.parametrize("mode", ["immediate", "fast"])
async def test_postgres_stopped_under_load_is_an_outage_not_an_error(
    tmp_path: Path, procs: list[Proc], mode: str
) -> None:
    pg = ThrowawayPostgres()
    pg.start()
    try:
        db = pg.new_database()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        node = await start_node(db, tmp_path / "state", tmp_path, node_id="n1", port=port)
        procs.append(node)
        load = await start_load_worker(url, tmp_path, name="load", max_jobs=50)
        procs.append(load)
        effects = tmp_path / "effects"
        slow = await start_worker(url, effects, tmp_path, slow=SLOW_STEP_S, name="slow")
        procs.append(slow)
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/events", json={"name": "crash.go"})
            slow_run = r.json()["run_ids"][0]
        await wait_effect(effects, slow_run, "two-start")

        emitter, ready = Emitter(url), ReadyProbe(url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ready.run)
            nursery.start_soon(emitter.run)
            await trio.sleep(2.0)
            down_at = time.time()
            await trio.to_thread.run_sync(pg.halt, mode)
            await trio.sleep(OUTAGE_S)
            await trio.to_thread.run_sync(pg.resume)
            back_at = time.time()
            await _poll_done(db, EVENTS + 1, timeout=60)
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

        assert ready.first_sent(503, down_at) - down_at <= READY_WITHIN_S
        assert ready.statuses(down_at + READY_WITHIN_S, back_at - 0.2) == {503}
        assert ready.first_sent(200, back_at) - back_at <= READY_WITHIN_S
        assert ready.statuses(back_at + READY_WITHIN_S, time.time()) == {200}
        _check_answers(emitter, "STORE_UNAVAILABLE", down_at, back_at)
        _check_node_log(node)
        for worker in (load, slow):
            assert worker.alive()
            assert "Connection to engine lost" not in worker.log_path.read_text(errors="replace")
        _, last_end = _check_runs(db, emitter, slow_run, effects)
        ends = [r[0] for r in db_rows(db, "SELECT ended_at FROM runs WHERE ended_at IS NOT NULL")]
        _report(f"postgres -m {mode}", emitter, back_at, last_end, ends, ready)
    finally:
        pg.stop()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


async def test_sqlite_on_a_full_disk_answers_507_and_recovers_when_space_returns(
    tmp_path: Path, procs: list[Proc]
) -> None:
    state = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(state, "24m"):
        pytest.skip("needs root to mount a small tmpfs (the in-process max_page_count test covers SQLite full)")
    try:
        db = str(state / "ironflow.db")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        node = await start_node(db, state / "node", tmp_path, node_id="n1", port=port)
        procs.append(node)
        load = await start_load_worker(url, tmp_path, name="load", max_jobs=50)
        procs.append(load)
        effects = tmp_path / "effects"
        slow = await start_worker(url, effects, tmp_path, slow=SLOW_STEP_S, name="slow")
        procs.append(slow)
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/events", json={"name": "crash.go"})
            slow_run = r.json()["run_ids"][0]
        await wait_effect(effects, slow_run, "two-start")

        filler = state / "filler"
        emitter, ready = Emitter(url), ReadyProbe(url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ready.run)
            nursery.start_soon(emitter.run)
            await trio.sleep(2.0)
            down_at = time.time()
            # Fill the file system to the last block: the WAL cannot grow.
            await trio.to_thread.run_sync(
                lambda: subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"],
                                       capture_output=True)
            )
            await trio.sleep(OUTAGE_S)
            filler.unlink()
            back_at = time.time()
            await _poll_done(db, EVENTS + 1, timeout=60)
            await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

        _check_answers(emitter, "STORAGE_FULL", down_at, back_at)
        assert 503 in ready.statuses(down_at, back_at)
        assert ready.first_sent(200, back_at) - back_at <= READY_WITHIN_S
        assert ready.statuses(back_at + READY_WITHIN_S, time.time()) == {200}
        _check_node_log(node, flaps=1)
        for worker in (load, slow):
            assert worker.alive()
            assert "Connection to engine lost" not in worker.log_path.read_text(errors="replace")
        _, last_end = _check_runs(db, emitter, slow_run, effects)
        assert db_rows(db, "PRAGMA integrity_check") == [("ok",)]
        ends = [r[0] for r in db_rows(db, "SELECT ended_at FROM runs WHERE ended_at IS NOT NULL")]
        _report("sqlite full disk", emitter, back_at, last_end, ends, ready)
    finally:
        for proc in procs:
            proc.stop()
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
