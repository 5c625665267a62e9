"""A streaming worker for the two-node PostgreSQL stress tests (docs/isolation.md).

Usage: python tests/procs/race_worker.py SERVER_URL EFFECTS_FILE [--max-jobs 200]

Functions it serves (all audited, so recoveries and ends are on the trail):

- ``racer`` (event ``race.start``, ``data.k`` its key): step ``begin`` marks
  ``begin:<key>``; then ``wait_for_event("go", event="race.go",
  match="data.k")`` for ``data.timeout`` seconds; returns the awaited event's
  ``{"k": data.k, "event_id": id}``, or ``{"k": None}`` if the wait timed out.
- ``lastcall`` (event ``last.start``): step ``first``; step ``last`` marks
  ``last`` and returns after a random pause of up to ``data.jitter`` seconds,
  so a cancel sent on the mark lands just before or just after the run ends.
- ``tally`` (event ``dl.go``, concurrency limit ``TALLY_LIMIT``): step
  ``count`` marks ``count-start``, pauses ``TALLY_PAUSE_S``, marks
  ``count-done``.
- ``parker`` (event ``dl.park``): waits for the ``dl.go`` whose ``data.k`` is
  its ``data.k`` (``data.timeout`` seconds), then step ``after`` marks ``after``.

Every mark is one line ``<time.time()> <run_id> <what> <pid>`` appended with
one ``write()`` (whole lines, also from a process killed a moment later), the
format of ``tests/integration/procs.read_effects``. Prints ``READY <pid>``
once registered.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ironflow  # noqa: E402

# Low enough that ``tally`` runs queue for capacity behind each other on two
# workers of many slots: the concurrency accounting is exercised on every ack.
TALLY_LIMIT = 8
# Long enough that a tally segment is in flight across group commits.
TALLY_PAUSE_S = 0.005


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("effects")
    parser.add_argument("--max-jobs", type=int, default=200)
    args = parser.parse_args()
    pid = os.getpid()
    fd = os.open(args.effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def mark(run_id: str, what: str) -> None:
        os.write(fd, f"{time.time():.6f} {run_id} {what} {pid}\n".encode())

    @ironflow.function(id="racer", triggers=[ironflow.event("race.start")], audit=True)
    async def racer(ctx: Any) -> Any:
        key = ctx.event.data["k"]

        async def begin() -> str:
            mark(ctx.run.id, f"begin:{key}")
            return key

        await ctx.step.run("begin", begin)
        got = await ctx.step.wait_for_event(
            "go", event="race.go", match="data.k", timeout=ctx.event.data["timeout"]
        )
        if got is None:
            return {"k": None}
        return {"k": got.data.get("k"), "event_id": got.id}

    @ironflow.function(id="lastcall", triggers=[ironflow.event("last.start")], audit=True)
    async def lastcall(ctx: Any) -> Any:
        async def first() -> int:
            return pid

        async def last() -> int:
            mark(ctx.run.id, "last")
            await trio.sleep(random.uniform(0, ctx.event.data.get("jitter", 0.0)))
            return pid

        await ctx.step.run("first", first)
        await ctx.step.run("last", last)
        return "done"

    @ironflow.function(
        id="tally", triggers=[ironflow.event("dl.go")], concurrency=TALLY_LIMIT, audit=True
    )
    async def tally(ctx: Any) -> Any:
        async def count() -> int:
            mark(ctx.run.id, "count-start")
            await trio.sleep(TALLY_PAUSE_S)
            mark(ctx.run.id, "count-done")
            return pid

        return await ctx.step.run("count", count)

    @ironflow.function(id="parker", triggers=[ironflow.event("dl.park")], audit=True)
    async def parker(ctx: Any) -> Any:
        got = await ctx.step.wait_for_event(
            "k", event="dl.go", match="data.k", timeout=ctx.event.data["timeout"]
        )

        async def after() -> int:
            mark(ctx.run.id, "after")
            return pid

        await ctx.step.run("after", after)
        return {"k": None if got is None else got.data.get("k")}

    worker = ironflow.StreamingWorker(
        args.server, [racer, lastcall, tally, parker],
        max_concurrent_jobs=args.max_jobs, reconnect_delay=0.2,
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            print(f"READY {pid}", flush=True)

    trio.run(run)


if __name__ == "__main__":
    main()
