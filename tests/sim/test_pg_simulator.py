"""The simulator on PostgreSQL (tests/sim/pg.py): two nodes, one database,
interleaved transactions. A bounded campaign, and proof that it finds the
races of docs/isolation.md with their fixes reverted (``tests/sim/bugs.py``
``PG_BUGS``): the stranded ack and the two lost-event races here; the false
stale is rare (a few in a hundred seeds: ``scripts/simulate.py --pg --bug
false_stale --seeds 300``), too slow for the suite.

``IRONFLOW_SIM_PG_SEEDS`` / ``IRONFLOW_SIM_PG_CAP_S`` change the campaign's
size and wall-clock cap; ``scripts/simulate.py --pg --seeds N --cap-s S``
runs a long one.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.sim.bugs import PG_BUGS
from tests.sim.pg import SimDatabases
from tests.sim.simulator import FAULT_KINDS, Result, run_seed

# Alone (`make test`'s serial phase): the campaign and the known-bug tests are
# bounded by wall time, and a seed's pauses are real time on a real PostgreSQL.
pytestmark = pytest.mark.serial

SEEDS = int(os.environ.get("IRONFLOW_SIM_PG_SEEDS", "20"))
# Wall clock (a PostgreSQL seed takes about 2 s here: its transactions pause).
CAMPAIGN_CAP_S = float(os.environ.get("IRONFLOW_SIM_PG_CAP_S", "50"))
# Fewer seeds than this within the cap is a failure, however busy the machine.
MIN_SEEDS = min(SEEDS, 8)
# Wall clock a known-bug test may spend before it must have found its race.
BUG_CAP_S = float(os.environ.get("IRONFLOW_SIM_PG_BUG_CAP_S", "120"))
# Seeds of the known-bug tests start here (not where the campaign's do).
BUG_SEEDS_FROM = 100_000

# Each race of docs/isolation.md, by what the oracle says when it happens.
RACES = {
    # activate_leases' one-statement form, from a session that is gone.
    "stranded_ack": ("(stranded: no queue row, no lease, no parked step)",),
    # an ingest's FOR UPDATE SKIP LOCKED passes over a parked wait it matches.
    "wait_row_skipped": ("(a wait row skipped)",),
    # a park's look-back and an ingest, each before the other committed.
    "park_and_ingest_missed": ("overlapped", "(the look-back missed it)"),
    # record_steps told StaleExecution after its rows were written.
    "false_stale": ("refused as stale, but it wrote step",),
    # a cron pass without its row lock and its tick claim (invariant 13).
    "cron_claim_unguarded": ("(one per tick)",),
}


def race_of(violation: str) -> str | None:
    for race, marks in RACES.items():
        if any(mark in violation for mark in marks):
            return race
    return None


@pytest.fixture(scope="module")
def sim_databases(pg_server: str) -> Iterator[SimDatabases]:
    dbs = SimDatabases(pg_server)
    try:
        yield dbs
    finally:
        dbs.close()


def test_a_campaign_on_postgresql_violates_no_invariant(sim_databases: SimDatabases) -> None:
    started = time.perf_counter()
    results: list[Result] = []
    for seed in range(SEEDS):
        results.append(run_seed(seed, pg=sim_databases))
        if time.perf_counter() - started > CAMPAIGN_CAP_S:
            break
    elapsed = time.perf_counter() - started
    faults: Counter[str] = Counter()
    for r in results:
        faults.update(r.counts)
    bad = [r for r in results if not r.ok]
    summary = (
        f"{len(results)} PostgreSQL seeds in {elapsed:.1f} s; "
        + ", ".join(f"{k}={faults[k]}" for k in (*FAULT_KINDS, "race_events"))
        + "; races: "
        + ", ".join(f"{k}={v}" for k, v in sorted(Counter(race_of(v) for r in bad for v in r.violations).items(), key=str))
    )
    print(summary)
    if len(results) < SEEDS:
        warnings.warn(f"the campaign stopped at its {CAMPAIGN_CAP_S:g} s cap: {summary}", stacklevel=1)
    assert len(results) >= MIN_SEEDS, summary
    assert not bad, "\n\n".join([summary] + [r.report() for r in bad[:3]])


def _first_seed_finding(race: str, dbs: SimDatabases) -> tuple[int, int, str]:
    """Seeds from BUG_SEEDS_FROM until one shows ``race``: (that seed, how many
    seeds it took, the violation). With the race's fix merged, ``PG_BUGS``
    holds a store that reverts it; before, the store as it is has it."""
    bug = race if race in PG_BUGS else None
    started = time.perf_counter()
    for n, seed in enumerate(range(BUG_SEEDS_FROM, BUG_SEEDS_FROM + 10_000), start=1):
        r = run_seed(seed, bug=bug, pg=dbs)
        for v in r.violations:
            if race_of(v) == race:
                return seed, n, v
        if time.perf_counter() - started > BUG_CAP_S:
            break
    raise AssertionError(f"{race}: not found within {BUG_CAP_S:g} s ({n} seeds)")


# Races found within a few seeds: the stranded ack (seed 100,002 here, the
# third); two nodes' schedulers, both waking just after a tick, firing it twice
# once the pass has neither its lock nor its claim (seed 100,000, 5 of the
# first 8). The others are found by script, each a few seeds in a hundred or
# fewer, too rare for a wall-time-capped test: the skipped wait row (about 1
# seed in 10, at ~7 s a seed since sim-b's flow control joined the schedule:
# seed 100,014 idle, none in 21 seeds under load), the false stale (about 125
# seeds) and the park/ingest overlap (its window is the few milliseconds the
# two transactions overlap): ``scripts/simulate.py --pg --bug wait_row_skipped``
# (or ``false_stale``, ``park_and_ingest_missed``); tests/store/test_pg_races.py
# forces each interleaving deterministically.
@pytest.mark.parametrize("race", ["stranded_ack", "cron_claim_unguarded"])
def test_the_postgresql_simulator_finds_each_race_with_its_fix_reverted(
    race: str, sim_databases: SimDatabases
) -> None:
    seed, n, violation = _first_seed_finding(race, sim_databases)
    print(f"{race}: seed {seed}, after {n} seeds: {violation}")
