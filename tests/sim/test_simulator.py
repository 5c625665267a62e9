"""The deterministic simulator's campaign, its determinism, and proof that it can fail.

``IRONFLOW_SIM_SEEDS`` changes the campaign's size (default 1,000 seeds, over
as many processes as there are cores); ``scripts/simulate.py --seed N``
replays any seed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

from tests.sim.schedule import build
from tests.sim.simulator import FAULT_KINDS, campaign, run_seed

REPO = Path(__file__).resolve().parents[2]
SEEDS = int(os.environ.get("IRONFLOW_SIM_SEEDS", "1000"))
# Wall-clock cap on the campaign, under the suite's 300 s per-test watchdog: on
# a machine busy with other work the campaign stops early (and says so) rather
# than be killed. 1,000 seeds take about a minute on an idle 2-core machine.
CAMPAIGN_CAP_S = float(os.environ.get("IRONFLOW_SIM_CAP_S", "200"))
# Fewer seeds than this within the cap is a failure, however busy the machine.
MIN_SEEDS = min(SEEDS, 200)
# How many seeds the bug-finding tests may spend before they must have found one.
BUG_BUDGET = 200


def test_a_campaign_of_seeds_violates_no_invariant() -> None:
    started = time.perf_counter()
    results = campaign(range(SEEDS), processes=os.cpu_count() or 1, deadline_s=CAMPAIGN_CAP_S)
    elapsed = time.perf_counter() - started
    faults: Counter[str] = Counter()
    for r in results:
        faults.update(r.counts)
    bad = [r for r in results if not r.ok]
    summary = (
        f"{len(results)} seeds in {elapsed:.1f} s ({len(results) / elapsed:.1f} seeds/s); "
        + ", ".join(f"{k}={faults[k]}" for k in FAULT_KINDS)
    )
    print(summary)
    if len(results) < SEEDS:
        warnings.warn(f"the campaign stopped at its {CAMPAIGN_CAP_S:g} s cap: {summary}", stacklevel=1)
    assert len(results) >= MIN_SEEDS, summary
    assert not bad, "\n\n".join([summary] + [r.report() for r in bad[:3]])
    # Every kind of fault was injected somewhere in the campaign.
    if len(results) >= 1000:
        assert all(faults[k] > 0 for k in FAULT_KINDS), summary
        assert faults["recoveries_exhausted"] > 0 and faults["loop2_restores"] > 0, summary


def test_a_seed_replays_exactly() -> None:
    # The private hook of Trio the simulator relies on (see deterministic_trio).
    import trio._core._run as trio_run

    assert hasattr(trio_run, "_ALLOW_DETERMINISTIC_SCHEDULING") and hasattr(trio_run, "_r")
    first = run_seed(7, keep_trace=True)
    again = run_seed(7, keep_trace=True)
    assert first.trace == again.trace and first.digest == again.digest
    assert first.counts == again.counts
    assert build(7).describe() == first.schedule
    assert run_seed(8).digest != first.digest


def test_a_seed_replays_exactly_in_another_process_with_another_hash_seed() -> None:
    """Nothing depends on str hashing, thread timing or the wall clock."""
    seed = 11
    here = run_seed(seed).digest
    code = f"from tests.sim.simulator import run_seed; print(run_seed({seed}).digest)"
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


def _first_violation(bug: str) -> tuple[int, list[str]]:
    results = campaign(
        range(BUG_BUDGET), bug=bug, processes=os.cpu_count() or 1, stop_at_first=True
    )
    for r in results:
        if not r.ok:
            return r.seed, r.violations
    raise AssertionError(f"{bug}: no violating seed among the first {BUG_BUDGET}")


def test_the_simulator_finds_a_write_accepted_from_a_fenced_execution() -> None:
    """Injected: ``record_step`` without its fence check (tests/sim/bugs.py)."""
    seed, violations = _first_violation("record_step_unfenced")
    assert any("accepted from a fenced execution" in v for v in violations), violations
    # The failing seed replays exactly, violations and all.
    again = run_seed(seed, bug="record_step_unfenced")
    assert again.violations == violations


def test_the_simulator_finds_a_segment_begun_and_ended_without_its_reservation() -> None:
    """Injected: a segment whose ack came with its result, begun and ended in
    one transaction, takes its queue row by run and seq alone — without the
    reservation's session and token (tests/sim/bugs.py). The session's
    completion group runs the store's own path here (``complete_jobs`` with
    ``activate``), judged per segment as its ack, steps and end together."""
    _, violations = _first_violation("begun_segment_unfenced")
    assert any("accepted from a fenced execution" in v for v in violations), violations


def test_the_simulator_finds_a_nack_that_spends_an_attempt() -> None:
    """Injected: a JobNack also bumps the run's attempt (tests/sim/bugs.py)."""
    _, violations = _first_violation("nack_spends_attempt")
    assert any("retries" in v for v in violations), violations


def test_the_simulator_finds_a_handler_started_before_its_sleeps_wake_time() -> None:
    """Injected: assignments lose their start delay, so a sleep the waker resumed
    ahead of its wake time (look-ahead) starts at once (tests/sim/bugs.py)."""
    _, violations = _first_violation("held_start_dropped")
    assert any("before the sleep's wake time" in v for v in violations), violations


def test_the_simulator_finds_a_concurrency_key_over_its_limit() -> None:
    """Injected: the dispatch counts no key's leases and reservations in the
    database, only its own picks (tests/sim/bugs.py): invariant 10."""
    _, violations = _first_violation("key_count_ignored")
    assert any("concurrency limit of sim-b of key" in v for v in violations), violations


def test_the_simulator_finds_a_throttle_ignored() -> None:
    """Injected: the dispatch never applies a throttle (tests/sim/bugs.py): invariant 11."""
    _, violations = _first_violation("throttle_ignored")
    assert any("throttle of sim-b" in v for v in violations), violations


def test_the_simulator_finds_a_singleton_with_two_runs_in_flight() -> None:
    """Injected: an ingest ignores the singleton's run in flight (tests/sim/bugs.py): invariant 12."""
    _, violations = _first_violation("singleton_ignored")
    assert any("singleton sim-s has 2 runs in flight" in v for v in violations), violations


def test_the_simulator_finds_a_late_cron_tick_taken_for_a_missed_one() -> None:
    """Injected: the scheduler reads every due tick as missed, so a tick fired
    milliseconds late is left to the catch-up policy (tests/sim/bugs.py):
    invariant 13, under ``catchup="none"``."""
    _, violations = _first_violation("late_tick_missed")
    assert any("has no run, though a node was up" in v for v in violations), violations


def test_the_simulator_finds_a_rate_limit_that_lets_one_extra_event_through() -> None:
    """Injected: the rate limit's GCRA one interval short, so a burst passes
    ``limit + 1`` events (tests/sim/bugs.py): invariant 14."""
    _, violations = _first_violation("rate_limit_one_extra")
    assert any("rate limit of sim-l (1 per 10s) broken" in v for v in violations), violations


def test_the_simulator_finds_a_debounced_run_that_keeps_its_first_event() -> None:
    """Injected: an event joining a quiet period moves the run's start but not
    its event (tests/sim/bugs.py): invariant 15."""
    _, violations = _first_violation("debounce_keeps_first_event")
    assert any("not its period's last" in v for v in violations), violations


def test_the_simulator_finds_two_debounced_runs_in_one_quiet_period() -> None:
    """Injected: a held queue row is never joined, every event opens a new
    period's run, or a new batch (tests/sim/bugs.py): invariants 15 and 16."""
    _, violations = _first_violation("debounce_never_joins")
    assert any("before the quiet period of run" in v for v in violations), violations
    assert any("opened batch run" in v for v in violations), violations


def test_the_simulator_finds_a_batch_over_its_max_size() -> None:
    """Injected: a batch's fill check one event short (tests/sim/bugs.py): invariant 16."""
    _, violations = _first_violation("batch_overfills")
    assert any("holds 4 events, max_size 3" in v for v in violations), violations
