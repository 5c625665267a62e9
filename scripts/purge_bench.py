"""How long one purge batch holds the SQLite writer, and how much the file shrinks.

Creates N finished 3-step runs in a fresh SQLite file (store level, no node,
no worker), moves the database clock past retention, then times every
``purge_history`` batch and every ``reclaim_space`` call, and prints the file
size (database + WAL, checkpointed) before the purge and after the space
came back::

    .venv/bin/python scripts/purge_bench.py --runs 5000
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ironflow.protocol import FunctionDef, Trigger  # noqa: E402  (needs REPO on sys.path)
from ironflow.store import Fence, Reservation, Store  # noqa: E402
from ironflow.store.retention import BATCH, VACUUM_PAGES  # noqa: E402
from tests.clock import SkewedSqliteStore  # noqa: E402  (the purge needs finished runs aged past retention)

# Runs created per round (one emit batch, one reservation pass).
ROUND = 100


def _checkpointed_size(path: Path) -> int:
    sqlite3.connect(path).execute("PRAGMA wal_checkpoint(TRUNCATE)").connection.close()
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


async def _finish(store: Store, res: Reservation) -> None:
    a = res.assignment
    fence = Fence(res.session_id, a.run_id, a.execution_seq, a.lease_token)
    await store.activate_lease(fence, lease_expiry_s=600)
    for s in range(3):
        await store.record_step(fence, step_id=f"s{s}", name=f"s{s}", status="completed", output=s)
    await store.complete_job(fence, {"ok": True})


async def _fill(store: Store, runs: int) -> None:
    info = await store.register_worker(
        node_id="n", worker_id="w", mode="stream", max_concurrent_jobs=ROUND,
        functions=[FunctionDef(id="f", triggers=[Trigger("e")])], session_expiry_s=10**6,
    )
    offer = {info.session_id: frozenset({"f"})}
    done = 0
    while done < runs:
        await store.ingest_events([("e", {"i": i}, None) for i in range(ROUND)], idempotency_window_s=1)
        reserved = await store.reserve_segments("n", offer, ROUND, reservation_expiry_s=600)
        async with trio.open_nursery() as nursery:
            for res in reserved:
                nursery.start_soon(_finish, store, res)
        done += len(reserved)


async def main(runs: int) -> None:
    path = Path(tempfile.mkdtemp(prefix="ifpurge.")) / "ironflow.db"
    store = SkewedSqliteStore(str(path))
    await store.open()
    try:
        await _fill(store, runs)
        await store.advance_clock(100)
        before = _checkpointed_size(path)
        batch_s: list[float] = []
        purged = 0
        while True:
            t0 = time.perf_counter()
            counts = await store.purge_history(older_than_s=10, idempotency_window_s=10, batch=BATCH)
            batch_s.append(time.perf_counter() - t0)
            purged += counts.runs
            if counts.runs < BATCH and counts.events < BATCH:
                break
        vacuum_s: list[float] = []
        pages = VACUUM_PAGES
        while pages == VACUUM_PAGES:
            t0 = time.perf_counter()
            pages = await store.reclaim_space(VACUUM_PAGES)
            vacuum_s.append(time.perf_counter() - t0)
    finally:
        await store.close()
    after = _checkpointed_size(path)
    shutil.rmtree(path.parent, ignore_errors=True)
    print(f"{runs} finished 3-step runs, {purged} purged in {len(batch_s)} batches of ≤ {BATCH}")
    print(f"purge batch: median {statistics.median(batch_s) * 1000:.1f} ms, max {max(batch_s) * 1000:.1f} ms")
    print(f"reclaim_space({VACUUM_PAGES}): {len(vacuum_s)} calls, max {max(vacuum_s) * 1000:.1f} ms")
    print(f"file: {before / 1e6:.2f} MB before ({before / runs:.0f} B/run), {after / 1e6:.2f} MB after")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5000)
    trio.run(main, ap.parse_args().runs)
