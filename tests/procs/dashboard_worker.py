"""A worker process for the dashboard's browser test.

Usage: python tests/procs/dashboard_worker.py SERVER_URL

Functions it serves:
- ``echo`` (event ``dash.echo``): step ``render`` returns the event's data
  as it came (the test sends an XSS payload through it), step ``count``
  returns how many keys it had; the run's output is both.
- ``napper`` (event ``dash.nap``): step ``prepare``, then sleeps an hour, so
  the run waits with a countdown until the test cancels it.
- ``crashy`` (event ``dash.crash``): step ``one``, then step ``two`` that
  hangs in the first process to reach it (so a kill -9 there leaves a
  recovered segment) and returns at once in the next.

Prints ``READY <pid>`` once registered.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402

# Marks that some process already began step two of a crashy run (the first one hangs).
STARTED_DIR = Path(os.environ.get("DASH_WORKER_STATE", "."))


@ironflow.function(id="echo", triggers=[ironflow.event("dash.echo")])
async def echo(ctx: Any) -> Any:
    rendered = await ctx.step.run("render", lambda: ctx.event.data)
    count = await ctx.step.run("count", lambda: len(ctx.event.data))
    return {"rendered": rendered, "count": count}


@ironflow.function(id="napper", triggers=[ironflow.event("dash.nap")])
async def napper(ctx: Any) -> Any:
    await ctx.step.run("prepare", lambda: "ready")
    await ctx.step.sleep("nap", 3600)
    return "rested"


@ironflow.function(id="crashy", triggers=[ironflow.event("dash.crash")])
async def crashy(ctx: Any) -> Any:
    marker = STARTED_DIR / f"{ctx.run.id}.two"

    async def two() -> int:
        first = not marker.exists()
        marker.touch()
        if first:
            print(f"HANGING {ctx.run.id}", flush=True)
            await anyio.sleep(3600)
        return os.getpid()

    await ctx.step.run("one", lambda: "one-done")
    return {"pid": await ctx.step.run("two", two)}


def main() -> None:
    worker = ironflow.StreamingWorker(sys.argv[1], [echo, napper, crashy], reconnect_delay=0.2)

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
