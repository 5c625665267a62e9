"""A worker process for crash tests and the recovery scripts.

Usage: python tests/procs/crash_worker.py SERVER_URL EFFECTS_FILE [--pull] [--slow S]

Functions it serves:
- ``crashy`` (event ``crash.go``): step ``one`` records a side effect; step
  ``two`` records ``two-start``, sleeps ``--slow`` seconds if no process has
  started it before (so only the first executor is slow), records
  ``two-done`` and returns the pid that finished it.
- ``suicide`` (event ``suicide.go``): records ``start`` and kills its own
  process with SIGKILL, every time.
- ``par`` (event ``par.go``): ``step.parallel`` of ``fast`` (records
  ``fast``) and ``slow`` (records ``slow-start``, sleeps ``--slow`` the first
  time, records ``slow-done``).
- ``keyed`` (event ``keyed.go``): step ``pay`` records ``pay-start`` and
  ``key:<its idempotency key>``, sleeping ``--slow`` the first time.
- ``sleepy`` (event ``sleepy.go``): step ``before`` records ``before``, a
  durable ``step.sleep`` of ``data.nap`` seconds (2 by default), step
  ``after`` records ``after`` and returns the pid that finished it.

Every side effect is one line ``<time.time()> <run_id> <what> <pid>``,
appended and flushed at once, so a test counts exactly what happened even in
a process that is killed a moment later.
"""

from __future__ import annotations

import argparse
import os
import signal
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
    parser.add_argument("effects")
    parser.add_argument("--pull", action="store_true")
    parser.add_argument("--slow", type=float, default=30.0)
    parser.add_argument("--max-jobs", type=int, default=1)
    args = parser.parse_args()
    effects = Path(args.effects)
    pid = os.getpid()

    def record(run_id: str, what: str) -> None:
        with effects.open("a") as f:
            f.write(f"{time.time():.6f} {run_id} {what} {pid}\n")
            f.flush()
            os.fsync(f.fileno())

    def already(run_id: str, what: str) -> bool:
        if not effects.exists():
            return False
        return any(
            line.split()[1:3] == [run_id, what] for line in effects.read_text().splitlines() if line
        )

    @ironflow.function(id="crashy", triggers=[ironflow.event("crash.go")])
    async def crashy(ctx: Any) -> Any:
        run_id = ctx.run.id

        async def one() -> str:
            record(run_id, "one")
            return "one-done"

        async def two() -> dict[str, int]:
            first = not already(run_id, "two-start")
            record(run_id, "two-start")
            if first:
                await anyio.sleep(args.slow)
            record(run_id, "two-done")
            return {"pid": pid}

        await ctx.step.run("one", one)
        return await ctx.step.run("two", two)

    @ironflow.function(id="suicide", triggers=[ironflow.event("suicide.go")])
    async def suicide(ctx: Any) -> Any:
        record(ctx.run.id, "start")
        os.kill(pid, signal.SIGKILL)
        await anyio.sleep(10)

    @ironflow.function(id="sleepy", triggers=[ironflow.event("sleepy.go")])
    async def sleepy(ctx: Any) -> Any:
        run_id = ctx.run.id

        async def before() -> str:
            record(run_id, "before")
            return "before-done"

        async def after() -> int:
            record(run_id, "after")
            return pid

        await ctx.step.run("before", before)
        await ctx.step.sleep("nap", ctx.event.data.get("nap", 2.0))
        return await ctx.step.run("after", after)

    @ironflow.function(id="par", triggers=[ironflow.event("par.go")])
    async def par(ctx: Any) -> Any:
        run_id = ctx.run.id

        async def fast() -> str:
            record(run_id, "fast")
            return "fast-done"

        async def slow() -> int:
            first = not already(run_id, "slow-start")
            record(run_id, "slow-start")
            if first:
                await anyio.sleep(args.slow)
            record(run_id, "slow-done")
            return pid

        return await ctx.step.parallel([("fast", fast), ("slow", slow)])

    @ironflow.function(id="keyed", triggers=[ironflow.event("keyed.go")])
    async def keyed(ctx: Any) -> Any:
        run_id = ctx.run.id

        async def pay() -> str:
            key = ironflow.step_info().idempotency_key
            first = not already(run_id, "pay-start")
            record(run_id, "pay-start")
            record(run_id, "key:" + key)
            if first:
                await anyio.sleep(args.slow)
            return key

        return await ctx.step.run("pay", pay)

    functions = [crashy, suicide, sleepy, par, keyed]
    worker: Any
    if args.pull:
        worker = ironflow.PullWorker(
            args.server, functions, max_concurrent_jobs=args.max_jobs, poll_wait=5.0, handle_signals=True
        )
    else:
        worker = ironflow.StreamingWorker(
            args.server, functions, max_concurrent_jobs=args.max_jobs, reconnect_delay=0.2
        )

    async def run() -> None:
        async with anyio.create_task_group() as nursery:
            await nursery.start(worker.run)
            print(f"READY {pid}", flush=True)

    worker_loop.run(run)


if __name__ == "__main__":
    main()
