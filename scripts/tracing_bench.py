"""Tracing's cost on throughput: scripts/bench.py with tracing on (the
OpenTelemetry SDK installed, every span made, none exported:
``OTEL_TRACES_EXPORTER=none`` for the node and the worker) against tracing
off (no SDK configured: the API's no-op spans), in alternating pairs so the
machine's drift cancels out.

Usage: python scripts/tracing_bench.py [--pairs 3] [--backend sqlite] [--runs 1000]

Prints each pair's steps/s and node + worker CPU per run, the on/off ratios,
then their medians. On a busy shared machine the CPU per run is the steadier
of the two: throughput also measures what else the cores were doing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench.py"


def one(backend: str, runs: int, traced: bool) -> tuple[float, float]:
    """(steps/s, node + worker CPU ms per run) of one bench.py repeat."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if traced:
        env["OTEL_TRACES_EXPORTER"] = "none"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--backend", backend, "--runs", str(runs), "--repeat", "1",
         "--idle-events", "1", "--latency", "1", "--json"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout
    row = json.loads(out)["backends"][backend]["median"]
    cpu_ms = (float(row["cpu_node_s"]) + float(row["cpu_worker_s"])) * 1000 / runs
    return float(row["steps_per_s"]), cpu_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--backend", default="sqlite", choices=["sqlite", "postgres"])
    ap.add_argument("--runs", type=int, default=1000)
    args = ap.parse_args()
    speed, cpu = [], []
    for i in range(args.pairs):
        off, off_cpu = one(args.backend, args.runs, traced=False)
        on, on_cpu = one(args.backend, args.runs, traced=True)
        speed.append(on / off)
        cpu.append(on_cpu / off_cpu)
        print(f"pair {i + 1}: steps/s off {off:,.0f} on {on:,.0f} (on/off {on / off:.3f});"
              f" CPU ms/run off {off_cpu:.2f} on {on_cpu:.2f} (on/off {on_cpu / off_cpu:.3f})",
              flush=True)
    print(f"{args.backend}, {args.pairs} pairs: median steps/s on/off {statistics.median(speed):.3f}"
          f" (min {min(speed):.3f}, max {max(speed):.3f}); median CPU per run on/off"
          f" {statistics.median(cpu):.3f} (min {min(cpu):.3f}, max {max(cpu):.3f})")


if __name__ == "__main__":
    main()
