"""Emit cost against the number of expression-filtered triggers on the event.

Usage: python scripts/filter_cost.py [--seconds 5] [--repeat 3] [--db URL | --pg]

Starts a node (SQLite in a temp dir, ``--db postgresql://…``, or ``--pg``: a
throwaway PostgreSQL with its default durability) and registers, through one
pull registration, functions whose trigger filter is false for every emit:
none on ``cost.0``, one on ``cost.1``, ten on ``cost.10``
(``event.data.amount > 100 && event.data.region == 'eu'``, each with its own
constant so none is a cached copy of another). Then, per round and per
variant in turn, emits ``cost.N`` events as fast as the node accepts them
(32 in flight) for ``--seconds`` and reports emits/s and the node's CPU per
emit; medians of ``--repeat`` rounds. Every emit of ``cost.1`` / ``cost.10``
is filtered by every trigger (its event record lists them: ``events.notes``);
no run starts, so the figures are the emit path and the filters alone.
Method and figures: docs/benchmarks.md (trigger filters).
"""

from __future__ import annotations

import argparse
import atexit
import os
import statistics
import sys
from typing import Any

import httpx
import trio
from children import REPO, cleanup_all, free_port, mkdtemp, spawn_dev_node, wait_ready

IN_FLIGHT = 32
VARIANTS = (0, 1, 10)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _functions() -> list[dict[str, Any]]:
    out = []
    for n in VARIANTS:
        for i in range(n):
            expression = f"event.data.amount > {100 + i} && event.data.region == 'eu'"
            out.append({"id": f"filtered-{n}-{i}", "triggers": [{"event": f"cost.{n}", "expression": expression}]})
    return out


async def _flood(url: str, name: str, seconds: float) -> tuple[int, float]:
    """Emits of ``name`` back to back (``IN_FLIGHT`` at once) for ``seconds``: (count, wall s)."""
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        t0 = trio.current_time()
        end = t0 + seconds

        async def loop() -> None:
            nonlocal done
            while trio.current_time() < end:
                resp = await http.post("/v1/events", json={"name": name, "data": {"amount": 5, "region": "us"}})
                resp.raise_for_status()
                assert not resp.json()["run_ids"]
                done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(IN_FLIGHT):
                nursery.start_soon(loop)
        return done, trio.current_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--db", default=None)
    parser.add_argument("--pg", action="store_true", help="start a throwaway PostgreSQL")
    args = parser.parse_args()
    if args.pg:
        sys.path.insert(0, str(REPO))
        from ironflow.testing import ThrowawayPostgres

        pg = ThrowawayPostgres(durable=True)
        pg.start()
        atexit.register(pg.stop)
        args.db = pg.new_database("filters")
    atexit.register(cleanup_all)
    state = mkdtemp("iffilters.")
    port = free_port()
    node = spawn_dev_node(args.db or f"{state}/ironflow.db", state, port)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, node)
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {"type": "register", "worker_id": "cost", "functions": _functions()}
        http.post("/v1/worker/register", json=body).raise_for_status()
        trio.run(_flood, url, "cost.0", 1.0)  # warm-up
        rows: dict[int, list[tuple[float, float]]] = {n: [] for n in VARIANTS}
        print(f"backend {'postgresql' if args.db else 'sqlite'}, {args.seconds:g} s per variant,"
              f" {args.repeat} rounds, {IN_FLIGHT} emits in flight", flush=True)
        for round_no in range(args.repeat):
            for n in VARIANTS:
                cpu0 = _cpu_s(node.pid)
                count, wall = trio.run(_flood, url, f"cost.{n}", args.seconds)
                cpu_ms = (_cpu_s(node.pid) - cpu0) * 1000 / count
                rows[n].append((count / wall, cpu_ms))
                print(f"  round {round_no + 1}, {n:2d} filtered triggers: {count / wall:7.1f} emits/s,"
                      f" node CPU {cpu_ms:.3f} ms per emit", flush=True)
        last = http.get("/v1/events", params={"include": "data", "name": "cost.10", "limit": 1}).json()["events"][0]
        assert len(last["filtered"]) == 10, last
    for n in VARIANTS:
        rate = statistics.median(r for r, _ in rows[n])
        cpu = statistics.median(c for _, c in rows[n])
        print(f"  median, {n:2d} filtered triggers: {rate:7.1f} emits/s, node CPU {cpu:.3f} ms per emit")


if __name__ == "__main__":
    sys.exit(main())
