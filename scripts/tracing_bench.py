"""Tracing's cost on throughput: scripts/bench.py with tracing on (the
OpenTelemetry SDK installed, every span made, none exported:
``OTEL_TRACES_EXPORTER=none`` for the node and the worker) against tracing
off (no SDK configured: the API's no-op spans), in alternating pairs so the
machine's drift cancels out.

Usage: python scripts/tracing_bench.py [--pairs 3] [--backend sqlite] [--runs 1000]

Prints each pair's steps/s and ratio (on / off), then the median ratio.
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


def one(backend: str, runs: int, traced: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if traced:
        env["OTEL_TRACES_EXPORTER"] = "none"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--backend", backend, "--runs", str(runs), "--repeat", "1",
         "--idle-events", "1", "--latency", "1", "--json"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout
    report = json.loads(out)
    return float(report["backends"][backend]["median"]["steps_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--backend", default="sqlite", choices=["sqlite", "postgres"])
    ap.add_argument("--runs", type=int, default=1000)
    args = ap.parse_args()
    ratios = []
    for i in range(args.pairs):
        off = one(args.backend, args.runs, traced=False)
        on = one(args.backend, args.runs, traced=True)
        ratios.append(on / off)
        print(f"pair {i + 1}: off {off:,.0f} steps/s, on {on:,.0f} steps/s, on/off {on / off:.3f}",
              flush=True)
    print(f"{args.backend}: median on/off {statistics.median(ratios):.3f} over {args.pairs} pairs"
          f" (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
