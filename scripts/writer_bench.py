"""The SQLite writer's statements and CPU per run, per store call, without HTTP.

Usage: python scripts/writer_bench.py [--runs 3000] [--group 10] [--backlog 300]
       [--trials 3]

Drives a ``SqliteStore`` (a temp file, its writer thread, no node) through a
fixed workload shaped like the node's under ``bench.py``'s load: per round,
``--group`` emits in one ``ingest_events`` (a group of emits), one
``reserve_segments`` for that many runs (a 50-slot worker session, with
``--backlog`` runs queued ahead), one ``activate_lease`` per reservation, all
at once (the writer groups them as it groups a session's acks), and one
``complete_jobs`` with three step results per run (a group of completions).
Rounds are sequential, so each writer group belongs to one call kind.

Per kind, per run: statements the writer ran (``set_trace_callback`` on its
connection; BEGIN/COMMIT counted apart) and the writer thread's CPU in those
groups (``time.thread_time()`` around each group commit). Fixed group sizes
keep these figures steady where ``bench.py``'s depend on timing: use it to
compare two trees (run it from each, alternating), not as a throughput figure.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ironflow.protocol import FunctionDef, Trigger  # noqa: E402
from ironflow.store.base import Fence, StepResult  # noqa: E402
from ironflow.store.sqlite import SqliteStore  # noqa: E402

KINDS = ("ingest", "reserve", "ack", "complete")


class _Counted(SqliteStore):
    """The store with its writer's groups timed and statements counted per kind."""

    kind = "setup"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.cpu: Counter[str] = Counter()
        self.statements: Counter[str] = Counter()
        self.transaction_statements: Counter[str] = Counter()

    def _connect(self) -> sqlite3.Connection:
        conn = super()._connect()

        def traced(sql: str) -> None:
            if sql.startswith(("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE")):
                self.transaction_statements[self.kind] += 1
            else:
                self.statements[self.kind] += 1

        conn.set_trace_callback(traced)
        return conn

    def _commit_group(self, conn: sqlite3.Connection, tx: Any, batch: list[Any]) -> None:  # type: ignore[override]
        kind = self.kind  # read before the results go back: the caller moves on
        began = time.thread_time()
        SqliteStore._commit_group(conn, tx, batch)
        self.cpu[kind] += time.thread_time() - began


async def _trial(runs: int, group: int, backlog: int) -> dict[str, tuple[float, float, float]]:
    """Per kind: (statements, BEGIN/COMMIT, writer CPU µs) per run."""
    with tempfile.TemporaryDirectory() as tmp:
        store = _Counted(os.path.join(tmp, "writer.db"))
        await store.open()
        try:
            session = await store.register_worker(
                node_id="n1", worker_id="w1", mode="stream", max_concurrent_jobs=50,
                functions=[FunctionDef(id="f", triggers=[Trigger("order.created")])],
                session_expiry_s=3600,
            )
            offers = {session.session_id: frozenset(session.function_ids)}
            events = [("order.created", {"i": i}, None) for i in range(group)]
            await store.ingest_events(
                [("order.created", {"i": i}, None) for i in range(backlog)], idempotency_window_s=60
            )
            for _ in range(runs // group):
                store.kind = "ingest"
                await store.ingest_events(events, idempotency_window_s=60)
                store.kind = "reserve"
                reserved = await store.reserve_segments("n1", offers, group, reservation_expiry_s=60)
                fences = [
                    Fence(r.session_id, r.assignment.run_id, r.assignment.execution_seq, r.assignment.lease_token)
                    for r in reserved
                ]
                store.kind = "ack"
                async with trio.open_nursery() as nursery:
                    for fence in fences:
                        nursery.start_soon(lambda f=fence: store.activate_lease(f, lease_expiry_s=60))
                store.kind = "complete"
                steps = [StepResult(f"s{k}", f"s{k}", "completed", {"k": k}, None, 1.0) for k in range(3)]
                done = await store.complete_jobs([(f, {"ok": True}, steps) for f in fences])
                if not all(d.unwrap().status == "completed" for d in done):
                    raise RuntimeError("a completion was refused")
        finally:
            await store.close()
    n = runs // group * group
    return {
        kind: (store.statements[kind] / n, store.transaction_statements[kind] / n, 1e6 * store.cpu[kind] / n)
        for kind in KINDS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--group", type=int, default=10)
    parser.add_argument("--backlog", type=int, default=300)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    trials = [trio.run(_trial, args.runs, args.group, args.backlog) for _ in range(args.trials)]
    print(f"per run, median of {args.trials} trials: statements, BEGIN/COMMIT, writer CPU µs")
    total = [0.0, 0.0, 0.0]
    for kind in KINDS:
        figures = [statistics.median(t[kind][i] for t in trials) for i in range(3)]
        total = [a + b for a, b in zip(total, figures, strict=True)]
        print(f"  {kind:9s} {figures[0]:6.2f} {figures[1]:6.2f} {figures[2]:8.1f}")
    print(f"  {'all':9s} {total[0]:6.2f} {total[1]:6.2f} {total[2]:8.1f}")


if __name__ == "__main__":
    main()
