"""The deterministic simulator of a whole node (tests/sim), from the command line.

Usage:
  python scripts/simulate.py --seed N [--trace]     one seed: its schedule, result, violations
  python scripts/simulate.py --seeds 10000 [--from 0] [--processes 2] [--bug NAME]
  python scripts/simulate.py --pg --seeds 500 [--cap-s 3600] [--bug NAME]   two nodes on PostgreSQL

``--pg`` runs the PostgreSQL mode (tests/sim/pg.py): two nodes on one real
PostgreSQL (a throwaway cluster, or the server at ``IRONFLOW_TEST_PG_URL``),
a fresh database per seed, transactions pausing 0-3 ms before each statement
and commit; seeds run one after another (``--processes`` is ignored), do not
replay exactly, and ``--cap-s`` stops the campaign after that many seconds.

A campaign prints seeds per second, faults injected by kind and every
violating seed (replay one with ``--seed N``; ``--trace`` prints what happened,
virtual time first). Exit status 1 when any seed violated an invariant.
``--bug`` injects one of the known bugs of ``tests/sim/bugs.py`` (the
simulator should then find violating seeds).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ironflow.testing import ThrowawayPostgres  # noqa: E402
from tests.sim.bugs import BUGS, PG_BUGS  # noqa: E402
from tests.sim.pg import SimDatabases  # noqa: E402
from tests.sim.simulator import FAULT_KINDS, Result, campaign, run_seed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, help="run this one seed and print its schedule")
    parser.add_argument("--seeds", type=int, default=0, help="run a campaign of this many seeds")
    parser.add_argument("--from", dest="first", type=int, default=0, help="first seed of the campaign")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--bug", choices=sorted({*BUGS, *PG_BUGS}), help="inject a known bug")
    parser.add_argument("--pg", action="store_true", help="two nodes on PostgreSQL (tests/sim/pg.py)")
    parser.add_argument("--cap-s", type=float, default=math.inf, help="stop a campaign after this many seconds")
    parser.add_argument("--trace", action="store_true", help="with --seed: print the trace")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        pg = None
        if args.pg:
            server = stack.enter_context(ThrowawayPostgres(os.environ.get("IRONFLOW_TEST_PG_URL")))
            pg = SimDatabases(server.url)
            stack.callback(pg.close)
        return run(parser, args, pg)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace, pg: SimDatabases | None) -> int:
    if args.seed is not None:
        r = run_seed(args.seed, bug=args.bug, keep_trace=args.trace, pg=pg)
        if args.trace:
            print("\n".join(r.trace))
        print(r.report())
        print("faults:", ", ".join(f"{k}={v}" for k, v in sorted(r.counts.items())))
        return 0 if r.ok else 1
    if not args.seeds:
        parser.error("give --seed N or --seeds COUNT")
    seeds = range(args.first, args.first + args.seeds)
    totals: Counter[str] = Counter()
    bad: list[Result] = []
    started = time.perf_counter()
    done = 0

    cpu_s: list[float] = []
    virtual = 0.0

    def on_result(r: Result) -> None:
        nonlocal done, virtual
        done += 1
        cpu_s.append(r.cpu_s)
        virtual += r.virtual_s
        totals.update(r.counts)
        if not r.ok:
            bad.append(r)
            print(f"seed {r.seed}: {len(r.violations)} violations: {r.violations[0]}", flush=True)
        if done % (20 if pg else 500) == 0:
            rate = done / (time.perf_counter() - started)
            mean_cpu = sum(cpu_s) / len(cpu_s)
            print(
                f"  {done} seeds, {rate:.1f} seeds/s, CPU {mean_cpu * 1000:.0f} ms/seed, violating {len(bad)};"
                + " ".join(f" {k}={totals[k]}" for k in sorted(totals)),
                flush=True,
            )

    campaign(seeds, bug=args.bug, processes=args.processes, on_result=on_result, pg=pg, deadline_s=args.cap_s)
    elapsed = time.perf_counter() - started
    print(
        f"{done} seeds in {elapsed:.1f} s ({done / elapsed:.1f} seeds/s, {args.processes} processes);"
        f" violating seeds: {len(bad)}"
    )
    cpu = sorted(cpu_s)
    if cpu:
        mean = sum(cpu) / len(cpu)
        print(
            f"CPU per seed: mean {mean * 1000:.0f} ms, median {cpu[len(cpu) // 2] * 1000:.0f} ms,"
            f" max {cpu[-1] * 1000:.0f} ms (so about {args.processes / mean:.1f} seeds/s on"
            f" {args.processes} idle cores); virtual time simulated: {virtual:.0f} s"
        )
    print("faults injected:")
    for kind in FAULT_KINDS:
        print(f"  {kind:<22} {totals[kind]}")
    print("also:", ", ".join(f"{k}={totals[k]}" for k in sorted(totals) if k not in FAULT_KINDS))
    for r in bad[:5]:
        print()
        print(r.report())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
