"""A streaming worker serving one function per ingest-side flow control
(tests/integration/test_flow_control.py).

Usage: python tests/procs/flow_worker.py SERVER_URL

- ``welcome`` (``flow.signup``): rate limit 1 per user per 10 s;
- ``digest`` (``flow.edit``): debounce 2 s per user; returns the event's ``n``;
- ``stream`` (``flow.tick``): debounce 2 s, max_wait 3 s; returns ``n``;
- ``sync`` (``flow.sync``): singleton per account, skip; sleeps 4 s durably;
- ``replace`` (``flow.replace``): singleton, cancel; sleeps 60 s durably;
- ``bulk`` (``flow.bulk``): batches of 100, timeout 3 s; returns the ``n`` of each event.

Prints ``READY <pid>`` once connected.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import worker_loop  # noqa: E402  (tests/procs, beside this file)

import ironflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    args = parser.parse_args()

    @ironflow.function(
        id="welcome", triggers=["flow.signup"],
        rate_limit=ironflow.RateLimit(1, "10s", key="event.data.user"),
    )
    async def welcome(ctx: Any) -> Any:
        return ctx.event.data

    @ironflow.function(id="digest", triggers=["flow.edit"], debounce=ironflow.Debounce("2s", key="event.data.user"))
    async def digest(ctx: Any) -> Any:
        return {"n": ctx.event.data["n"]}

    @ironflow.function(id="stream", triggers=["flow.tick"], debounce=ironflow.Debounce(2, max_wait="3s"))
    async def stream(ctx: Any) -> Any:
        return {"n": ctx.event.data["n"]}

    @ironflow.function(id="sync", triggers=["flow.sync"], singleton=ironflow.Singleton(key="event.data.account"))
    async def sync(ctx: Any) -> Any:
        await ctx.step.sleep("hold", 4)
        return ctx.event.data

    @ironflow.function(id="replace", triggers=["flow.replace"], singleton=ironflow.Singleton(mode="cancel"))
    async def replace(ctx: Any) -> Any:
        await ctx.step.sleep("hold", 60)
        return ctx.event.data

    @ironflow.function(id="bulk", triggers=["flow.bulk"], batch=ironflow.Batch(100, timeout="3s"))
    async def bulk(ctx: Any) -> Any:
        assert ctx.event.id == ctx.events[0].id
        return {"n": [e.data["n"] for e in ctx.events]}

    worker = ironflow.StreamingWorker(
        args.server, [welcome, digest, stream, sync, replace, bulk], max_concurrent_jobs=20,
        reconnect_delay=0.2,
    )

    worker_loop.serve(worker)


if __name__ == "__main__":
    main()
