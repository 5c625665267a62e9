"""A worker process for the graceful-drain tests: real signals, real exits.

Usage: python tests/procs/drain_worker.py SERVER_URL EFFECTS_FILE
       [--workers stream,pull] [--slow S] [--max-jobs N] [--drain-timeout S]
       [--configure-logging] [--advertise N]

It runs one worker per entry of ``--workers`` in one Trio run (one process)
and configures no logging unless ``--configure-logging`` is given (then
``logging.basicConfig`` at INFO, as an application would).

``--advertise N`` registers N slots with the engine while running at most
``--max-jobs``: the engine's credits exceed the worker's free slots, as after
a reconnect, so an assignment past ``--max-jobs`` is refused ``AT_CAPACITY``
(streaming workers only).

Functions:
- ``slow`` (event ``drain.go``): records ``start``, sleeps ``--slow`` seconds
  in a step, records ``done`` and returns the pid.
- ``flaky`` (event ``flaky.go``, 3 attempts, 0.1 s backoff): records
  ``start``; on attempt 1 raises a plain (retryable) error, on later attempts
  returns the pid.

Every side effect is one line ``<time.time()> <run_id> <what> <pid>`` (as in
``crash_worker.py``).
"""

from __future__ import annotations

import argparse
import logging
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
    parser.add_argument("effects")
    parser.add_argument("--workers", default="stream")
    parser.add_argument("--slow", type=float, default=3.0)
    parser.add_argument("--max-jobs", type=int, default=1)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--configure-logging", action="store_true")
    parser.add_argument("--advertise", type=int, default=None)
    args = parser.parse_args()
    if args.configure_logging:
        logging.basicConfig(level=logging.INFO, format="APP %(levelname)s %(name)s: %(message)s")
    effects = Path(args.effects)
    pid = os.getpid()

    def record(run_id: str, what: str) -> None:
        with effects.open("a") as f:
            f.write(f"{time.time():.6f} {run_id} {what} {pid}\n")
            f.flush()
            os.fsync(f.fileno())

    @ironflow.function(id="slow", triggers=[ironflow.event("drain.go")])
    async def slow(ctx: Any) -> Any:
        run_id = ctx.run.id

        async def work() -> dict[str, int]:
            record(run_id, "start")
            await anyio.sleep(args.slow)
            record(run_id, "done")
            return {"pid": pid}

        return await ctx.step.run("work", work)

    @ironflow.function(
        id="flaky",
        triggers=[ironflow.event("flaky.go")],
        retries={"max_attempts": 3, "initial_delay_s": 0.1},
    )
    async def flaky(ctx: Any) -> Any:
        record(ctx.run.id, "start")
        if ctx.run.attempt < 2:
            raise RuntimeError("transient failure on the first attempt")
        return {"pid": pid}

    class Overcommitted(ironflow.StreamingWorker):
        """Registers ``--advertise`` slots, runs ``--max-jobs``: the SDK's own
        refusal (and its log line) with the real number of slots."""

        def _refusal(self, a: Any) -> Any:
            advertised = self.max_concurrent_jobs
            self.max_concurrent_jobs = args.max_jobs
            try:
                return super()._refusal(a)
            finally:
                self.max_concurrent_jobs = advertised

    functions = [slow, flaky]
    workers: list[Any] = []
    for kind in args.workers.split(","):
        common: dict[str, Any] = {
            "max_concurrent_jobs": args.max_jobs,
            "drain_timeout": args.drain_timeout,
            "reconnect_delay": 0.2,
        }
        if kind == "pull":
            workers.append(ironflow.PullWorker(args.server, functions, poll_wait=2.0, **common))
        elif args.advertise:
            common["max_concurrent_jobs"] = args.advertise
            workers.append(Overcommitted(args.server, functions, **common))
        else:
            workers.append(ironflow.StreamingWorker(args.server, functions, **common))

    async def run() -> None:
        async with anyio.create_task_group() as nursery:
            for worker in workers:
                await nursery.start(worker.run)
            print(f"READY {pid}", flush=True)

    worker_loop.run(run)


if __name__ == "__main__":
    main()
