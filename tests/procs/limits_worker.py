"""A streaming worker serving one function per dispatch-side flow control
(tests/integration/test_flow_dispatch_procs.py). Each handler runs one step
that sleeps, so a run holds its lease (and its slot) long enough for the test
to see it in the database.

Usage: python tests/procs/limits_worker.py SERVER_URL [--slots N] [--id ID]
       [--only FUNCTION] [--hold S] [--wait-for PATH]

- ``keyed`` (``lim.keyed``): concurrency 2 per ``data.key``; 0.3 s;
- ``fair`` (``lim.fair``): concurrency 2 per ``data.key``; 0.2 s;
- ``throttled`` (``lim.throttle``): throttle 5 per second; 0.3 s;
- ``ranked`` (``lim.rank``): concurrency 1 (one run at a time: the queue
  behind it is served by priority), priority 60 s when ``data.pro``;
  ``data.s`` seconds (0.1 by default);
- ``holder`` (``lim.hold``): concurrency 1 per ``data.key``; ``--hold`` s
  (0.3 by default: a killed worker's replacement finishes quickly).

``--only`` serves one of them. ``--wait-for`` connects only once that file
exists (the process starts, and imports, while the test sets up). Prints
``READY <pid>`` once connected.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402


async def _nap(seconds: float) -> float:
    await anyio.sleep(seconds)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("--slots", type=int, default=10)
    parser.add_argument("--id", default=None, help="the worker id its session records")
    parser.add_argument("--only", default=None)
    parser.add_argument("--hold", type=float, default=0.3)
    parser.add_argument("--wait-for", type=Path, default=None)
    args = parser.parse_args()
    per_key = ironflow.Concurrency(2, key="event.data.key")

    @ironflow.function(id="keyed", triggers=["lim.keyed"], concurrency=per_key)
    async def keyed(ctx: Any) -> Any:
        return await ctx.step.run("work", _nap, 0.3)

    @ironflow.function(id="fair", triggers=["lim.fair"], concurrency=per_key)
    async def fair(ctx: Any) -> Any:
        return await ctx.step.run("work", _nap, 0.2)

    @ironflow.function(id="throttled", triggers=["lim.throttle"], throttle=ironflow.Throttle(5, "1s"))
    async def throttled(ctx: Any) -> Any:
        return await ctx.step.run("work", _nap, 0.3)

    @ironflow.function(
        id="ranked", triggers=["lim.rank"], concurrency=1, priority="event.data.pro ? 60 : 0",
    )
    async def ranked(ctx: Any) -> Any:
        return await ctx.step.run("work", _nap, float(ctx.event.data.get("s", 0.1)))

    @ironflow.function(
        id="holder", triggers=["lim.hold"], concurrency=ironflow.Concurrency(1, key="event.data.key"),
    )
    async def holder(ctx: Any) -> Any:
        return await ctx.step.run("work", _nap, args.hold)

    functions = [keyed, fair, throttled, ranked, holder]
    if args.only:
        functions = [f for f in functions if f.id == args.only]
    worker = ironflow.StreamingWorker(
        args.server, functions, max_concurrent_jobs=args.slots, reconnect_delay=0.2, worker_id=args.id,
    )

    async def run() -> None:
        while args.wait_for is not None and not args.wait_for.exists():
            await anyio.sleep(0.02)
        async with anyio.create_task_group() as nursery:
            await nursery.start(worker.run)
            print(f"READY {os.getpid()}", flush=True)

    worker_loop.run(run)


if __name__ == "__main__":
    main()
