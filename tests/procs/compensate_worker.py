"""A worker process for the compensation test (``tests/integration/test_compensation_procs.py``).

Usage: python tests/procs/compensate_worker.py SERVER_URL EFFECTS_FILE GATE_FILE

Every side effect appends ``<run_id> <what> <pid>`` to EFFECTS_FILE.

``saga3`` (event ``saga.go``): steps ``reserve`` (undo ``release``),
``charge`` (undo ``refund``, given the charge's output), then ``ship``, which
fails non-retryably. The undos run newest-first: ``refund``, then
``release``, which records ``release-start`` and waits for GATE_FILE to exist
before it records ``release``.

``hold`` (event ``hold.go``): step ``book`` (undo ``unbook``), a second undo
``notify`` that fails, then a wait for ``hold.confirmed`` that nobody sends:
cancelled, ``notify`` fails (recorded) and ``unbook`` still runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402

# How often the gated undo looks for its gate file.
GATE_POLL_S = 0.02


def main() -> None:
    server, effects, gate = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

    def record(run_id: str, what: str) -> None:
        with effects.open("a") as f:
            f.write(f"{run_id} {what} {os.getpid()}\n")

    @ironflow.function(id="saga3", triggers=[ironflow.event("saga.go")])
    async def saga3(ctx: Any) -> Any:
        run_id = ctx.run.id

        def reserve() -> str:
            record(run_id, "reserve")
            return "sku-1"

        def release(sku: str) -> None:  # a sync undo: runs in a thread
            record(run_id, "release-start")
            while not gate.exists():
                time.sleep(GATE_POLL_S)
            record(run_id, f"release:{sku}")

        async def charge() -> dict[str, str]:
            record(run_id, "charge")
            return {"id": "ch_1"}

        async def refund(charge: dict[str, str]) -> None:
            record(run_id, f"refund:{charge['id']}")

        def ship() -> None:
            record(run_id, "ship")
            raise ironflow.NonRetryableError("no courier today")

        sku = await ctx.step.run("reserve", reserve)
        await ctx.step.compensate("release", release, sku)
        paid = await ctx.step.run("charge", charge)
        await ctx.step.compensate("refund", refund, paid)
        await ctx.step.run("ship", ship)
        return "shipped"

    @ironflow.function(id="hold", triggers=[ironflow.event("hold.go")])
    async def hold(ctx: Any) -> Any:
        run_id = ctx.run.id

        def notify() -> None:
            record(run_id, "notify")
            raise RuntimeError("mail server down")

        await ctx.step.run("book", lambda: record(run_id, "book"))
        await ctx.step.compensate("unbook", lambda: record(run_id, "unbook"))
        await ctx.step.compensate("notify", notify)
        return await ctx.step.wait_for_event("confirm", event="hold.confirmed", timeout=3600)

    worker = ironflow.StreamingWorker(server, [saga3, hold], max_concurrent_jobs=4, reconnect_delay=0.2)

    async def run() -> None:
        async with anyio.create_task_group() as nursery:
            await nursery.start(worker.run)
            print(f"READY {os.getpid()}", flush=True)

    worker_loop.run(run)


if __name__ == "__main__":
    main()
