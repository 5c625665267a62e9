"""A streaming worker for the cancel-on process test (docs/triggers.md).

Usage: python tests/procs/cancel_worker.py SERVER_URL

Serves ``drip`` (event ``user.created``, cancelled by ``user.unsubscribed``
with the same ``data.user_id``): by ``data.kind``, it sleeps durably
(``sleep``), runs a 60 s step (``step``: cancelled mid-step), or invokes
``slow-child`` (``invoke``), which sleeps durably. Prints ``READY <pid>``
once connected; logs ``Run cancelled; cancelling job`` when told.
"""

from __future__ import annotations

import argparse
import logging
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
    logging.basicConfig(level=logging.INFO)

    @ironflow.function(id="slow-child")
    async def slow_child(ctx: Any) -> Any:
        await ctx.step.sleep("long", 600)
        return "child"

    @ironflow.function(
        id="drip", triggers=[ironflow.event("user.created")],
        cancel_on=[ironflow.CancelOn("user.unsubscribed", match="data.user_id")],
    )
    async def drip(ctx: Any) -> Any:
        kind = ctx.event.data["kind"]
        if kind == "sleep":
            await ctx.step.sleep("wait-a-day", 600)
        elif kind == "step":
            await ctx.step.run("slow", anyio.sleep, 60)
        else:
            await ctx.step.invoke("child", function=slow_child, data={})
        return "never"

    worker = ironflow.StreamingWorker(args.server, [drip, slow_child], max_concurrent_jobs=8, reconnect_delay=0.2)

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
