"""Client round trip: ``send`` an event → ``result()`` returned, for a 1-step run.

Usage: python scripts/result_latency.py [--runs 300] [--db postgresql://…] [--trials 3] [--step sync]

Starts a ``--dev`` node (SQLite unless ``--db``) and one streaming worker
process, then, sequentially, sends an event and awaits the run's output with
``Ironflow.result()`` (the node holds the request open and answers when it
ends the run). Prints p50/p99 per trial and the median of the trials' p50s.

The step's body is an ``async def`` by default, as in Restate's 1-step
handler (``../shared/peers/restate/app.py``); ``--step sync`` makes it a
plain lambda, which the SDK runs in a thread (~1–2 ms more on this machine).
"""

from __future__ import annotations

import argparse
import atexit
import statistics
import time

import trio
from children import cleanup_all, serve_worker_until_stopped, start_dev_node, start_script_worker


def worker_main(url: str, step: str) -> None:
    import ironflow

    async def data_of(ctx):  # type: ignore[no-untyped-def]
        return ctx.event.data

    @ironflow.function(id="echo", triggers=[ironflow.event("echo.go")])
    async def echo(ctx):  # type: ignore[no-untyped-def]
        if step == "sync":
            return await ctx.step.run("echo", lambda: ctx.event.data)
        return await ctx.step.run("echo", data_of, ctx)

    worker = ironflow.StreamingWorker(url, [echo], max_concurrent_jobs=10)
    serve_worker_until_stopped(worker)


def start(db: str | None, step: str) -> str:
    url = start_dev_node(db, "ifres.")
    start_script_worker(__file__, url, ["--step", step])
    return url


async def trial(url: str, runs: int) -> list[float]:
    import ironflow

    samples = []
    async with ironflow.Ironflow(url) as client:
        for i in range(runs + 20):
            t0 = time.perf_counter()
            sent = await client.send("echo.go", {"i": i})
            out = await client.result(sent.run_ids[0], timeout=30)
            if i >= 20:  # warm-up
                samples.append((time.perf_counter() - t0) * 1000)
            assert out == {"i": i}
    return sorted(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--db", default=None)
    parser.add_argument("--step", choices=("async", "sync"), default="async",
                        help="the step body: an async def (as Restate's) or a sync lambda (run in a thread)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.step)
        return
    atexit.register(cleanup_all)
    url = start(args.db, args.step)
    p50s, p99s = [], []
    for n in range(args.trials):
        samples = trio.run(trial, url, args.runs)
        p50, p99 = statistics.median(samples), samples[int(len(samples) * 0.99) - 1]
        p50s.append(p50)
        p99s.append(p99)
        print(f"trial {n + 1}: send → result() p50 {p50:.2f} ms, p99 {p99:.2f} ms ({len(samples)} runs)")
    print(f"median over {args.trials} trials: p50 {statistics.median(p50s):.2f} ms, p99 {statistics.median(p99s):.2f} ms")


if __name__ == "__main__":
    main()
