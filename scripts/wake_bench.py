"""Wake-up lateness: ``wake_at`` → handler resumed on the worker, for many sleeps due at once.

Usage: python scripts/wake_bench.py [--sleeps 1000] [--db postgresql://…] [--lead 5]

Starts a ``--dev`` node (SQLite unless ``--db``) and one streaming worker with
200 slots. Emits ``--sleeps`` runs (one batch request) of a function that
sleeps until the same instant, ``--lead`` seconds ahead, then records
``time.time()`` in a step the moment its handler resumes. Prints the lateness
p50/p99/max (resumed − wake_at) and how long the last one took.
"""

from __future__ import annotations

import argparse
import atexit
import statistics
import time

import httpx
from children import cleanup_all, serve_worker_until_stopped, start_dev_node, start_script_worker

WORKER_SLOTS = 200


def worker_main(url: str) -> None:
    import ironflow

    @ironflow.function(id="napper", triggers=[ironflow.event("nap.go")])
    async def napper(ctx):  # type: ignore[no-untyped-def]
        await ctx.step.sleep_until("nap", ctx.event.data["at"])
        return await ctx.step.run("woke", time.time)

    worker = ironflow.StreamingWorker(url, [napper], max_concurrent_jobs=WORKER_SLOTS)
    serve_worker_until_stopped(worker)


def start(db: str | None) -> str:
    url = start_dev_node(db, "ifwake.")
    start_script_worker(__file__, url)
    return url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sleeps", type=int, default=1000)
    parser.add_argument("--lead", type=float, default=5.0, help="seconds until the common wake time")
    parser.add_argument("--db", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    atexit.register(cleanup_all)
    url = start(args.db)
    with httpx.Client(base_url=url, timeout=120) as http:
        at = round(time.time() + args.lead, 3)
        events = [{"name": "nap.go", "data": {"at": at}} for _ in range(args.sleeps)]
        run_ids = [r for e in http.post("/v1/events/batch", json={"events": events}).json()["events"]
                   for r in e["run_ids"]]
        parked = time.time()
        if parked > at:
            raise SystemExit(f"emitting took past the wake time; raise --lead (took {parked - at + args.lead:.1f} s)")
        late: list[float] = []
        deadline = time.time() + args.lead + 120
        for run_id in run_ids:
            while True:
                run = http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30}).json()
                if run["ended"] or time.time() > deadline:
                    break
            late.append((run["output"] - at) * 1000)
    late.sort()
    print(f"{args.sleeps} sleeps due at the same instant ({'PostgreSQL' if args.db else 'SQLite'}):"
          f" lateness p50 {statistics.median(late):.1f} ms, p99 {late[int(len(late) * 0.99) - 1]:.1f} ms,"
          f" min {late[0]:.1f} ms, max {late[-1]:.1f} ms")


if __name__ == "__main__":
    main()
