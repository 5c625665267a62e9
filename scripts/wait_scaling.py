"""Emits of an event name against the number of waits parked on that name.

Usage: python scripts/wait_scaling.py [--waits 20000] [--rate 100] [--seconds 10] [--repeat 3]
       [--db URL | --pg]

Starts a node (SQLite in a temp dir, ``--db postgresql://…``, or ``--pg``: a
throwaway PostgreSQL with its default durability) and a worker
serving two functions: ``oneshot`` (event ``race.go``, one step) and
``parker`` (event ``park.go``: ``wait_for_event("race.go", match="data.k")``
for its own key, an hour's timeout). Then, on the empty database and again
with ``--waits`` parkers parked (their keys matching none of the emits),
offers ``race.go`` emits at ``--rate`` per second for ``--seconds`` (up to 32
in flight), each starting one ``oneshot`` run, and reports the rate the node
accepted, the emit latency, and the node's CPU per run (every emitted run
completed). The target: the second within 10 % of the first. Before
the wait key every emit read every parked wait of its name.
"""

from __future__ import annotations

import argparse
import atexit
import os
import statistics
import sys
import time
from typing import Any

import httpx
import trio
from children import (
    REPO,
    cleanup_all,
    free_port,
    mkdtemp,
    spawn_dev_node,
    start_script_worker,
    wait_ready,
)

# Emits in flight at once while offering the rate (a node that keeps up never has this many).
IN_FLIGHT = 32
WAIT_TIMEOUT_S = 3600


def serve(url: str) -> None:
    """The worker (``--worker URL``)."""
    from children import serve_worker_until_stopped

    import ironflow

    async def nothing() -> int:
        return 1

    @ironflow.function(id="oneshot", triggers=[ironflow.event("race.go")])
    async def oneshot(ctx: Any) -> Any:
        return await ctx.step.run("one", nothing)

    @ironflow.function(id="parker", triggers=[ironflow.event("park.go")])
    async def parker(ctx: Any) -> Any:
        return await ctx.step.wait_for_event("w", event="race.go", match="data.k", timeout=WAIT_TIMEOUT_S)

    serve_worker_until_stopped(ironflow.StreamingWorker(url, [oneshot, parker], max_concurrent_jobs=200))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _counts(http: httpx.Client, function_id: str) -> dict[str, int]:
    stats = http.get("/v1/stats/runs", params={"window_s": 86400, "bucket_s": 3600}).json()
    return {f["status"]: f["count"] for f in stats["functions"] if f["function_id"] == function_id}


def _wait_for(http: httpx.Client, function_id: str, status: str, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _counts(http, function_id).get(status, 0) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{function_id}: {_counts(http, function_id)} after {timeout_s:g} s, want {n} {status}")
        time.sleep(0.2)


async def _offer(url: str, rate: float, seconds: float, first_key: int) -> tuple[int, float, list[float]]:
    """``race.go`` emits at ``rate``/s for ``seconds``; (accepted, wall s, latencies ms)."""
    latencies: list[float] = []
    limiter = trio.CapacityLimiter(IN_FLIGHT)
    total = int(rate * seconds)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        t0 = trio.current_time()

        async def one(i: int) -> None:
            async with limiter:
                s = time.perf_counter()
                (await http.post("/v1/events", json={"name": "race.go", "data": {"k": -(first_key + i)}})).raise_for_status()
                latencies.append((time.perf_counter() - s) * 1000)

        async with trio.open_nursery() as nursery:
            for i in range(total):
                await trio.sleep_until(t0 + i / rate)
                await limiter.acquire_on_behalf_of(i)  # the offered rate stalls when the node falls behind
                limiter.release_on_behalf_of(i)
                nursery.start_soon(one, i)
        wall = trio.current_time() - t0
    return total, wall, latencies


def _phase(http: httpx.Client, url: str, node_pid: int, args: argparse.Namespace, label: str, done_before: int,
           first_key: int) -> tuple[int, dict[str, Any]]:
    cpu0 = _cpu_s(node_pid)
    total, wall, latencies = trio.run(_offer, url, args.rate, args.seconds, first_key)
    _wait_for(http, "oneshot", "completed", done_before + total, 300)
    cpu = _cpu_s(node_pid) - cpu0
    latencies.sort()
    row = {
        "phase": label, "accepted_per_s": total / wall, "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1], "node_cpu_ms_per_run": cpu * 1000 / total,
    }
    print(f"  {label:>24}: {row['accepted_per_s']:6.1f} emits/s accepted, emit p50 {row['p50_ms']:5.1f} ms"
          f" p99 {row['p99_ms']:6.1f} ms, node CPU {row['node_cpu_ms_per_run']:.2f} ms per run", flush=True)
    return done_before + total, row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waits", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--db", default=None)
    parser.add_argument("--pg", action="store_true", help="start a throwaway PostgreSQL")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(args.worker)
        return
    if args.pg:
        sys.path.insert(0, str(REPO))
        from ironflow.testing import ThrowawayPostgres

        pg = ThrowawayPostgres(durable=True)
        pg.start()
        atexit.register(pg.stop)
        args.db = pg.new_database("waits")
    atexit.register(cleanup_all)  # before pg.stop (atexit runs last-registered first)
    state = mkdtemp("ifwaits.")
    port = free_port()
    node = spawn_dev_node(args.db or f"{state}/ironflow.db", state, port)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, node)
    start_script_worker(__file__, url)
    print(f"backend {'postgresql' if args.db else 'sqlite'}, offered {args.rate:g} emits/s for {args.seconds:g} s,"
          f" {args.repeat} rounds per phase", flush=True)
    with httpx.Client(base_url=url, timeout=60) as http:
        done, key = 0, 0
        rows: list[dict[str, Any]] = []
        for _ in range(args.repeat):
            done, row = _phase(http, url, node.pid, args, "0 waits parked", done, key)
            rows.append(row)
            key += int(args.rate * args.seconds)
        t0 = time.monotonic()

        async def park() -> None:
            limiter = trio.CapacityLimiter(IN_FLIGHT)
            async with httpx.AsyncClient(base_url=url, timeout=60) as ahttp:
                async def one(i: int) -> None:
                    async with limiter:
                        (await ahttp.post("/v1/events", json={"name": "park.go", "data": {"k": i}})).raise_for_status()

                async with trio.open_nursery() as nursery:
                    for i in range(args.waits):
                        nursery.start_soon(one, i)

        trio.run(park)
        _wait_for(http, "parker", "waiting", args.waits, 1800)
        print(f"  parked {args.waits:,} waits on race.go in {time.monotonic() - t0:.0f} s", flush=True)
        for _ in range(args.repeat):
            done, row = _phase(http, url, node.pid, args, f"{args.waits:,} waits parked", done, key)
            rows.append(row)
            key += int(args.rate * args.seconds)
        if _counts(http, "parker").get("waiting", 0) != args.waits:
            raise SystemExit(f"a non-matching emit resolved a wait: {_counts(http, 'parker')}")
    empty = [r for r in rows if r["phase"] == "0 waits parked"]
    full = [r for r in rows if r["phase"] != "0 waits parked"]
    for key_name in ("accepted_per_s", "node_cpu_ms_per_run", "p50_ms"):
        a = statistics.median(r[key_name] for r in empty)
        b = statistics.median(r[key_name] for r in full)
        print(f"  median {key_name}: {a:.2f} empty -> {b:.2f} with waits ({b / a:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
