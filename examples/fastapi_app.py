"""A FastAPI service that runs its Ironflow worker in its own process, on asyncio.

Run an engine (``ironflow serve --dev``), then::

    IRONFLOW_SERVER_URL=http://127.0.0.1:9123 uvicorn examples.fastapi_app:app --port 8000
    curl -X POST localhost:8000/orders -H 'content-type: application/json' -d '{"amount": 5}'

Each ``POST /orders`` emits ``order.placed``; the function it triggers runs
in this same process (the worker started in the lifespan, beside the app's
own tasks) and its output is the response, awaited with
``client.result(...)``. On shutdown (Ctrl+C: uvicorn owns the signals) the
lifespan's exit drains the worker: running jobs finish, new ones go to other
workers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request

import ironflow

# How long a request waits for its run before answering 504 (the run goes on).
RESULT_TIMEOUT_S = 30.0


@ironflow.function(id="place-order", triggers=[ironflow.event("order.placed")])
async def place_order(ctx: ironflow.Context) -> dict[str, Any]:
    amount = ctx.event.data["amount"]

    async def price() -> float:
        await asyncio.sleep(0.01)  # any asyncio library works here: the app's loop
        return round(amount * 1.2, 2)

    total = await ctx.step.run("price", price)
    receipt = await ctx.step.run("receipt", lambda: f"order of {amount} -> {total}")
    return {"total": total, "receipt": receipt}


def create_app(server_url: str | None = None) -> FastAPI:
    """The app; ``server_url`` defaults to ``IRONFLOW_SERVER_URL`` (tests pass their node's)."""
    url = server_url or os.environ.get("IRONFLOW_SERVER_URL", "http://127.0.0.1:9123")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker = ironflow.StreamingWorker(url, [place_order], drain_timeout=20)
        async with ironflow.Ironflow(url) as client, worker.running():
            app.state.client = client  # one client, shared by every request
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders")
    async def create_order(request: Request, body: dict[str, Any]) -> Any:
        client: ironflow.Ironflow = request.app.state.client
        emitted = await client.emit("order.placed", {"amount": body.get("amount", 1)})
        (run_id,) = emitted.run_ids
        try:
            return await client.result(run_id, timeout=RESULT_TIMEOUT_S)
        except TimeoutError as exc:
            raise HTTPException(504, f"run {run_id} is still running") from exc

    return app


app = create_app()
