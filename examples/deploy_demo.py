"""The graceful-drain seed's demo worker, in Python.

Run an engine (``ironflow serve --dev``), then ``python examples/deploy_demo.py``,
then ``ironflow emit deploy.demo --data '{}'`` and press Ctrl+C while the
15-second step runs: the worker logs ``Draining worker...`` and
``Waiting for 1 jobs to complete...``, finishes the job, and exits.
"""

from __future__ import annotations

import logging
import os

import trio

import ironflow


@ironflow.function(id="deploy-demo", triggers=[ironflow.event("deploy.demo")])
async def process_order(ctx: ironflow.Context) -> object:
    ctx.logger.info(f"Starting run {ctx.run.id}")

    async def work() -> dict[str, bool]:
        await trio.sleep(15)
        return {"processed": True}

    return await ctx.step.run("process-order", work)


worker = ironflow.StreamingWorker(
    os.environ.get("IRONFLOW_SERVER_URL", "http://localhost:9123"),
    [process_order],
    api_key=os.environ.get("IRONFLOW_API_KEY"),
    max_concurrent_jobs=1,
    drain_timeout=30.0,
)

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(worker.run)
