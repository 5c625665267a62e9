"""A rolling restart of worker processes under steady load (seed: docs/seeds/graceful-drain.txt).

Usage: python scripts/rolling_restart.py [--rate 200] [--workers 4] [--slots 25]
                                         [--work-ms 50] [--before 10] [--gap 2]
                                         [--after 5] [--rounds 1] [--db postgresql://…]

Starts one ``--dev`` node (SQLite in a temp dir unless ``--db``; loop 1 on
the seed's timings, lease 90 s and heartbeat 30 s, unless ``--dev-timings``) and
``--workers`` streaming worker processes (``--slots`` slots each) serving
``rolling`` (event ``roll.go``): one step that takes ``--work-ms``. A load
thread emits a steady ``--rate`` runs/s (a batch every 20 ms) for the whole
test. After ``--before`` seconds, the workers are restarted one at a time, as
a deploy does: SIGTERM to the old process and, at the same moment, the
replacement started; once the old one has exited and the replacement is
ready, ``--gap`` seconds, then the next (``--rounds R``: every worker R
times over, for more nacks to measure). Load goes on ``--after`` seconds
past the last restart, then the script waits for every run to end.

Reported, from the database (runs and audit records, read through the store
after the node stopped) and from the workers' own notes of each handler
start (a JSON-lines file per process):

* failed runs: every emitted run that did not complete;
* attempts spent: runs with ``attempt`` > 1 (a retry, i.e. a handler failure);
* recoveries: the sum of ``recovery_count`` (lease recoveries of lost work);
* run latency (``created_at`` → ``ended_at``, database clock) p50/p99 of the
  runs created before the restarts (the first 2 s left out as warm-up) and of
  those created during them;
* every ``JobNack`` (reason, from ``capacity.job.nacked``) and, per nack, the
  time from the nack's commit to the run's next handler start on any worker,
  p50/p99;
* each old worker's exit code (0 = drained cleanly).

Everything printed is measured by this run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from children import LIVE, REPO, TEMPS, child_env, cleanup_all, mkdtemp, spawn_node, stop

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TICK_S = 0.02
WARMUP_S = 2.0


# ── worker mode (a subprocess) ───────────────────────────────────────────────


def worker_main(url: str, out: str, slots: int, work_ms: float) -> None:
    import os

    import trio

    import ironflow

    pid = os.getpid()
    notes: list[str] = []

    async def work() -> int:
        await trio.sleep(work_ms / 1000.0)
        return pid

    @ironflow.function(id="rolling", triggers=[ironflow.event("roll.go")])
    async def rolling(ctx: Any) -> Any:
        notes.append(json.dumps({"run": ctx.run.id, "start": time.time(), "pid": pid}))
        return await ctx.step.run("work", work)

    # Signals drain the worker (the SDK's default): this is what is measured.
    worker = ironflow.StreamingWorker(url, [rolling], max_concurrent_jobs=slots, reconnect_delay=0.5)

    def flush(fh: Any) -> None:
        if notes:
            fh.write("\n".join(notes) + "\n")
            fh.flush()
            notes.clear()

    async def main() -> None:
        with open(out, "a") as fh:
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    print(f"READY {worker.session_id}", flush=True)

                    async def flusher() -> None:
                        while True:
                            await trio.sleep(0.05)
                            flush(fh)

                    nursery.start_soon(flusher)
                    await worker._finished.wait()
                    nursery.cancel_scope.cancel()
            finally:
                flush(fh)

    trio.run(main)


# ── the driver ───────────────────────────────────────────────────────────────


class Worker:
    def __init__(self, url: str, tmp: Path, name: str, args: argparse.Namespace) -> None:
        self.out = tmp / f"{name}.jsonl"
        self.session = ""
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", url, "--out", str(self.out),
                "--slots", str(args.slots), "--work-ms", str(args.work_ms)]
        with open(tmp / f"{name}.log", "wb") as log:
            self.proc = subprocess.Popen(argv, env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=log)
        LIVE.append(self.proc)

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().split()
        if not line or line[0] != "READY":
            raise SystemExit(f"worker {self.proc.pid} did not start")
        self.session = line[1]


class Load(threading.Thread):
    """Emits ``rate`` runs/s, a batch every ``TICK_S`` (what the clock owes), until stopped."""

    def __init__(self, url: str, rate: float) -> None:
        super().__init__(daemon=True)
        self.url, self.rate = url, rate
        self.stopping = threading.Event()
        self.run_ids: list[str] = []
        self.errors = 0
        self.elapsed = 0.0

    def run(self) -> None:
        import httpx

        start = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=30) as http:
            tick = 0
            while not self.stopping.is_set():
                # Owed by the clock, not by the tick: a slow request is caught up
                # by the next batch, so the rate holds whatever one request takes.
                n = int(self.rate * (time.monotonic() - start)) - len(self.run_ids)
                if n > 0:
                    events = [{"name": "roll.go", "data": {}} for _ in range(n)]
                    try:
                        resp = http.post("/v1/events/batch", json={"events": events})
                        resp.raise_for_status()
                        self.run_ids += [r for e in resp.json()["events"] for r in e["run_ids"]]
                    except httpx.HTTPError:
                        self.errors += 1
                tick += 1
                time.sleep(max(0.0, start + tick * TICK_S - time.monotonic()))
        self.elapsed = time.monotonic() - start


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))]


def restart_all(url: str, tmp: Path, workers: list[Worker], args: argparse.Namespace,
                drained: set[str]) -> list[int]:
    """One worker at a time: SIGTERM the old, start the replacement; returns old exit codes
    (``drained`` gets the old workers' session ids)."""
    codes = []
    for k in range(args.rounds * len(workers)):
        i = k % len(workers)
        old = workers[i]
        old.proc.send_signal(signal.SIGTERM)
        drained.add(old.session)
        new = Worker(url, tmp, f"worker{i}-{k}", args)
        new.wait_ready()
        codes.append(old.proc.wait(timeout=60))
        workers[i] = new
        print(f"  worker {i}: old exited {codes[-1]}, replacement ready", file=sys.stderr, flush=True)
        time.sleep(args.gap)
    return codes


async def read_outcome(db: str) -> tuple[list[Any], list[Any], list[Any]]:
    from ironflow.store import open_store

    store = open_store(db)
    await store.open()
    try:
        runs = await store.list_runs(function_id="rolling", limit=10**7)
        nacks = await store.list_audit(type="capacity.job.nacked", limit=10**6)
        lost = await store.list_audit(type="capacity.lease.expired", limit=10**6)
    finally:
        await store.close()
    return runs, nacks, lost


def report(args: argparse.Namespace, load: Load, runs: list[Any], nacks: list[Any],
           starts: dict[str, list[tuple[float, int]]], window: tuple[float, float, float], codes: list[int]) -> None:
    t0, r0, r1 = window
    by_id = {r.id: r for r in runs}
    emitted = [by_id[i] for i in load.run_ids if i in by_id]
    failed = [r for r in emitted if r.status != "completed"]
    lat_before = [(r.ended_at - r.created_at) * 1000 for r in emitted
                  if r.ended_at and t0 + WARMUP_S <= r.created_at < r0]
    lat_during = [(r.ended_at - r.created_at) * 1000 for r in emitted if r.ended_at and r0 <= r.created_at <= r1]
    nack_gaps: list[float] = []
    reasons: dict[str, int] = {}
    for n in nacks:
        reasons[n.data["reason"]] = reasons.get(n.data["reason"], 0) + 1
        later = [t for t, _ in starts.get(n.run_id or "", []) if t >= n.at]
        if later:
            nack_gaps.append((min(later) - n.at) * 1000)
    print(f"rolling restart ({args.rounds} round{'s' * (args.rounds > 1)}) of {args.workers} workers ({args.slots} slots each, {args.work_ms:g} ms of work per run)"
          f" at {args.rate:g} runs/s, {'PostgreSQL' if args.db else 'SQLite'}:")
    print(f"  runs emitted {len(load.run_ids)} in {load.elapsed:.1f} s ({len(load.run_ids) / load.elapsed:.0f}/s,"
          f" emit errors {load.errors}); failed or unfinished {len(failed)}")
    print(f"  attempts spent (runs with attempt > 1): {sum(1 for r in emitted if r.attempt > 1)}")
    print(f"  recoveries (sum of recovery_count): {sum(r.recovery_count for r in emitted)}")
    print(f"  run latency before the restarts: p50 {pct(lat_before, 50):.0f} ms, p99 {pct(lat_before, 99):.0f} ms"
          f" ({len(lat_before)} runs)")
    print(f"  run latency during the restarts ({r1 - r0:.1f} s): p50 {pct(lat_during, 50):.0f} ms,"
          f" p99 {pct(lat_during, 99):.0f} ms ({len(lat_during)} runs)")
    print(f"  nacks {len(nacks)} {reasons}; nack → next handler start p50 {pct(nack_gaps, 50):.1f} ms,"
          f" p99 {pct(nack_gaps, 99):.1f} ms, max {max(nack_gaps, default=float('nan')):.1f} ms"
          f" ({len(nack_gaps)} measured)")
    print(f"  old workers' exit codes: {codes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="runs emitted per second")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=25, help="each worker's max_concurrent_jobs")
    ap.add_argument("--work-ms", type=float, default=50.0, help="the handler's one step takes this long")
    ap.add_argument("--before", type=float, default=10.0, help="seconds of load before the first restart")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between one restart and the next")
    ap.add_argument("--after", type=float, default=5.0, help="seconds of load after the last restart")
    ap.add_argument("--rounds", type=int, default=1, help="restart every worker this many times")
    ap.add_argument("--db", default=None, help="a postgresql:// URL (default: SQLite in a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (node and worker logs)")
    ap.add_argument("--dev-timings", action="store_true",
                    help="keep --dev's short loop-1 timings (lease 6 s, grace 1 s) instead of the seed's")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, args.out, args.slots, args.work_ms)
        return
    atexit.register(cleanup_all)
    import trio

    tmp = Path(mkdtemp("ifroll."))
    if args.keep:
        TEMPS.remove(str(tmp))
        print(f"logs in {tmp}", file=sys.stderr)
    db = args.db or str(tmp / "ironflow.db")
    # --dev for the key-less API, but loop 1 on the seed's (production) timings
    # unless --dev-timings: a deploy is measured, and on a loaded machine a 6 s
    # lease can expire under a live worker whose heartbeat the node read late.
    seed_timings = [] if args.dev_timings else [
        "--heartbeat-interval", "30", "--session-expiry", "90", "--lease-expiry", "90",
        "--scanner-interval", "30", "--reservation-expiry", "30", "--recovery-grace", "30",
        "--stale-claim-threshold", "120", "--stale-claim-interval", "60"]
    node = spawn_node(db, tmp / "state", tmp / "node.log", node_id="node", extra=seed_timings)
    workers = [Worker(node, tmp, f"worker{i}", args) for i in range(args.workers)]
    for w in workers:
        w.wait_ready()
    load = Load(node, args.rate)
    t0 = time.time()
    load.start()
    time.sleep(args.before)
    r0 = time.time()
    drained: set[str] = set()
    codes = restart_all(node, tmp, workers, args, drained)
    r1 = time.time()
    outs = sorted(tmp.glob("worker*.jsonl"))
    time.sleep(args.after)
    load.stopping.set()
    load.join()
    # Let every run end (the node is alive): then stop everyone, workers first.
    import httpx

    with httpx.Client(base_url=node, timeout=30) as http:
        for _ in range(1200):
            if not any(http.get("/v1/runs", params={"status": s, "limit": 1}).json()["runs"]
                       for s in ("waiting", "running")):
                break
            time.sleep(0.1)
    for proc in list(LIVE):
        stop(proc)
    runs, nacks, lost = trio.run(read_outcome, db)
    starts: dict[str, list[tuple[float, int]]] = {}
    for out in outs:
        if out.exists():
            for line in out.read_text().splitlines():
                note = json.loads(line)
                starts.setdefault(note["run"], []).append((note["start"], note["pid"]))
    report(args, load, runs, nacks, starts, (t0, r0, r1), codes)
    from_drained = sum(1 for a in lost if a.data.get("session_id") in drained)
    print(f"  leases recovered (capacity.lease.expired): {len(lost)}, of them {from_drained} held by"
          f" a drained worker's session")


if __name__ == "__main__":
    main()
