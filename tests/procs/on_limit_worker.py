"""A streaming worker with one slot serving the concurrency ``on_limit``
strategies (tests/integration/test_flow_on_limit.py).

Usage: python tests/procs/on_limit_worker.py SERVER_URL

- ``gate`` (``gate.go``): 1 per account, ``skip``; holds its slot 2 s;
- ``latest`` (``latest.go``): 1 in all, ``cancel_in_progress``; a step that
  sleeps the event's ``hold`` seconds, then returns the event's data.

One slot: a cancelled run the worker did not stop would keep it, and the
run that replaced it could not start.

Prints ``READY <pid>`` once connected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    args = parser.parse_args()

    @ironflow.function(
        id="gate", triggers=["gate.go"],
        concurrency=ironflow.Concurrency(1, key="event.data.account", on_limit="skip"),
    )
    async def gate(ctx: Any) -> Any:
        await anyio.sleep(2)
        return ctx.event.data

    @ironflow.function(
        id="latest", triggers=["latest.go"], concurrency={"limit": 1, "on_limit": "cancel_in_progress"},
    )
    async def latest(ctx: Any) -> Any:
        await ctx.step.run("hold", anyio.sleep, ctx.event.data["hold"])
        return ctx.event.data

    worker = ironflow.StreamingWorker(
        args.server, [gate, latest], max_concurrent_jobs=1, reconnect_delay=0.2,
    )

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
