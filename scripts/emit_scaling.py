"""Emit latency against the number of registered functions (the trigger index).

Usage: python scripts/emit_scaling.py [--functions 20000] [--emits 400] [--db URL]

Starts a SQLite node (or uses --db postgresql://…), measures the median and
p99 latency of sequential single-event emits with one registered function,
then registers ``--functions`` more (each on its own trigger, through pull
registrations of 1,000) and measures again: an emit that matches nothing,
and one that starts a run. With the trigger index the ratio stays near 1;
before it every emit read and decoded every definition.
"""

from __future__ import annotations

import argparse
import atexit
import statistics
import time

import httpx
from children import cleanup_all, start_dev_node

BATCH = 1000


def start_node(db: str | None) -> str:
    return start_dev_node(db, "ifscale.", ["--max-functions-per-worker", str(BATCH)])


def register(http: httpx.Client, ids: list[str]) -> None:
    functions = [{"id": i, "triggers": [{"event": f"{i}.go"}]} for i in ids]
    resp = http.post("/v1/worker/register", json={"type": "register", "worker_id": "scale", "functions": functions})
    resp.raise_for_status()


def emit_latencies(http: httpx.Client, name: str, n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        http.post("/v1/events", json={"name": name, "data": {}}).raise_for_status()
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", type=int, default=20_000)
    parser.add_argument("--emits", type=int, default=400)
    parser.add_argument("--db", default=None)
    args = parser.parse_args()
    atexit.register(cleanup_all)
    url = start_node(args.db)
    with httpx.Client(base_url=url, timeout=60) as http:
        register(http, ["f0"])
        emit_latencies(http, "warm.up", 50)
        rows = [("1 function", "no match", *emit_latencies(http, "nothing.here", args.emits))]
        rows.append(("1 function", "1 run", *emit_latencies(http, "f0.go", args.emits)))
        t0 = time.perf_counter()
        for start in range(1, args.functions + 1, BATCH):
            register(http, [f"f{i}" for i in range(start, min(start + BATCH, args.functions + 1))])
        took = time.perf_counter() - t0
        n = f"{args.functions + 1:,} functions"
        rows.append((n, "no match", *emit_latencies(http, "nothing.here", args.emits)))
        rows.append((n, "1 run", *emit_latencies(http, "f7.go", args.emits)))
    print(f"registered {args.functions:,} functions in {took:.1f} s ({BATCH} per registration)")
    print(f"{'registered':>18} | {'emit':>8} | {'p50 ms':>7} | {'p99 ms':>7}")
    for who, what, p50, p99 in rows:
        print(f"{who:>18} | {what:>8} | {p50:7.2f} | {p99:7.2f}")
    base = {what: p50 for _, what, p50, _ in rows[:2]}
    for _, what, p50, _ in rows[2:]:
        print(f"ratio {what}: {p50 / base[what]:.2f}x")


if __name__ == "__main__":
    main()
