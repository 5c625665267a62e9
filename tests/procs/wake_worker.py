"""A streaming worker for the wake-claim tests: durable sleeps due at a given instant.

Usage: python tests/procs/wake_worker.py SERVER_URL [--effects FILE] [--max-jobs 200]

Serves ``napper`` (event ``nap.go``, audit on, so the node records
``step.woke`` and ``step.claim.restored``): with ``data.before`` a step
``before``; then ``step.sleep_until("nap", data.at)``; then a step ``after``
that returns the pid. With ``--effects`` each of the two steps appends
``<time.time()> <run_id> before|after <pid>`` to FILE, and the handler appends
``… resumed …`` the moment it is past the sleep (on every segment that gets
there). Prints ``READY <pid>`` once connected.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("--effects", default=None)
    parser.add_argument("--max-jobs", type=int, default=200)
    args = parser.parse_args()
    pid = os.getpid()

    def record(run_id: str, what: str) -> int:
        if args.effects:
            with open(args.effects, "a") as f:
                f.write(f"{time.time():.6f} {run_id} {what} {pid}\n")
                f.flush()
                os.fsync(f.fileno())
        return pid

    @ironflow.function(id="napper", triggers=[ironflow.event("nap.go")], audit=True)
    async def napper(ctx: Any) -> Any:
        run_id = ctx.run.id
        if ctx.event.data.get("before"):
            await ctx.step.run("before", record, run_id, "before")
        await ctx.step.sleep_until("nap", ctx.event.data["at"])
        record(run_id, "resumed")
        return await ctx.step.run("after", record, run_id, "after")

    worker = ironflow.StreamingWorker(
        args.server, [napper], max_concurrent_jobs=args.max_jobs, reconnect_delay=0.2
    )

    async def run() -> None:
        async with anyio.create_task_group() as nursery:
            await nursery.start(worker.run)
            print(f"READY {pid}", flush=True)

    worker_loop.run(run)


if __name__ == "__main__":
    main()
