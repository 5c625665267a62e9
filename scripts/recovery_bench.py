#!/usr/bin/env python
"""Recovery latency after ``kill -9`` of a worker in the middle of a step.

    python scripts/recovery_bench.py [--scenario streaming|pull|all] [--repeat 3]
                                     [--timings default|dev] [--backend sqlite|postgres]
                                     [--json] [--slow 600] [--keep]

For each repeat a FRESH node is started as a subprocess (``python -m
ironflow serve --db <fresh db> --port <free> --state-dir <tmp>``, plus ``--dev``
with ``--timings dev``). With default timings the node is NOT started with
``--dev``, so org endpoints need an API key: one org admin key is minted
straight in the fresh database before the node starts, sent as
``Authorization: Bearer`` on every HTTP call of this script and given to the
workers as ``IRONFLOW_API_KEY``.

The workers are ``tests/procs/crash_worker.py`` (function ``crashy`` on event
``crash.go``; side-effect lines ``<time.time()> <run_id> <what> <pid>``).
The SDK's workers read their key from ``IRONFLOW_API_KEY``.

Scenario, per repeat:

1. worker A connected (streaming, or ``--pull``), ``--slow 600`` so the first
   executor of step two sleeps far longer than the measurement;
2. emit ``crash.go``; wait for A's ``two-start`` effect;
3. start worker B (same mode), wait for its ``READY`` line;
4. pull only: read ``GET /v1/runs/{id}`` → lease left = ``lease.expires_at -
   db_now``;
5. ``t_kill = time.time()``; ``kill -9`` A;
6. poll ``GET /v1/runs/{id}`` every 10 ms until ``completed`` (progress lines on
   stderr every 10 s);
7. measure from ``t_kill``:
   (1) the ``capacity.segment.recovered`` audit event's ``at`` for the run,
   (2) B's ``two-start`` effect (resumed on the peer),
   (3) the run's ``ended_at``.
   Pull also reports ``(2) - (lease left + recovery grace)``: the overhead on
   top of the two clocks (no scanner or dispatch tick should be added).

Every figure is the difference of two wall-clock readings on this machine
(``time.time()`` in this script and the worker, the database clock in the
node: SQLite uses the node's ``time.time()``, the throwaway PostgreSQL runs
on the same host). Reported per repeat and as the MEDIAN over repeats, next
to the seed's figures (115 s kill → recovery audit pair, 148 s kill → run
completed, measured on the original product).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ironflow.testing import ThrowawayPostgres  # noqa: E402  (needs REPO on sys.path)

CRASH_WORKER = REPO / "tests" / "procs" / "crash_worker.py"
SEED = {"recovered_s": 115.0, "completed_s": 148.0}
# The recovery grace of each timing profile (docs/operations.md, "Configuration").
GRACE_S = {"default": 30.0, "dev": 1.0}
LEASE_S = {"default": 90.0, "dev": 6.0}

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ═══════════════════════════════════════════════════════════════════════════
# process helpers
# ═══════════════════════════════════════════════════════════════════════════

from children import LIVE as _LIVE  # noqa: E402
from children import TEMPS as _TEMPS  # noqa: E402
from children import child_env as _env  # noqa: E402
from children import cleanup_all as _cleanup_all  # noqa: E402
from children import free_port as _free_port  # noqa: E402
from children import mkdtemp as _mkdtemp  # noqa: E402
from children import stop as _stop  # noqa: E402


class Worker:
    """A crash_worker.py process; stdout is read by a thread for ``READY``."""

    def __init__(self, server: str, effects: Path, log_path: Path, *, pull: bool, slow: float,
                 api_key: str | None) -> None:
        self.log_path = log_path
        argv = [sys.executable, str(CRASH_WORKER), server, str(effects), "--slow", str(slow)]
        if pull:
            argv.append("--pull")
        extra: dict[str, str] = {}
        if api_key:
            extra["IRONFLOW_API_KEY"] = api_key
        fh = open(log_path, "wb")
        try:
            self.popen = subprocess.Popen(argv, cwd=str(REPO), env=_env(extra), stdout=subprocess.PIPE,
                                          stderr=fh, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            fh.close()
        _LIVE.append(self.popen)
        self.pid = self.popen.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self.lines.put(raw.decode(errors="replace").strip())
        self.lines.put(None)

    def wait_ready(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"worker {self.pid} not READY within {timeout}s; log:\n{self.tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"worker {self.pid} exited ({self.popen.poll()}) before READY; "
                                   f"log:\n{self.tail()}")
            if line.startswith("READY"):
                pid = int(line.split()[1])
                if pid != self.pid:
                    raise RuntimeError(f"worker announced pid {pid}, spawned {self.pid}")
                return pid

    def kill9(self) -> float:
        """SIGKILL; returns time.time() read just before it was sent."""
        at = time.time()
        os.kill(self.pid, signal.SIGKILL)
        return at

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        _stop(self.popen, grace=2.0)


def mint_org_key(db: str) -> str:
    """Create the schema (if needed) and one org admin key straight in ``db``."""
    import trio

    from ironflow.store import open_store

    async def go() -> str:
        store = open_store(db)
        await store.open()
        try:
            _, key = await store.create_api_key("org", "admin")
            return key
        finally:
            await store.close()

    return trio.run(go)


# ═══════════════════════════════════════════════════════════════════════════
# measurement
# ═══════════════════════════════════════════════════════════════════════════


def read_effects(path: Path) -> list[tuple[float, str, str, int]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((float(parts[0]), parts[1], parts[2], int(parts[3])))
    return rows


def find_effect(path: Path, run_id: str, what: str, pid: int) -> tuple[float, str, str, int] | None:
    for row in read_effects(path):
        if row[1] == run_id and row[2] == what and row[3] == pid:
            return row
    return None


def wait_effect(path: Path, run_id: str, what: str, pid: int, timeout: float) -> tuple[float, str, str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = find_effect(path, run_id, what, pid)
        if row:
            return row
        time.sleep(0.005)
    raise RuntimeError(f"no {what!r} effect of pid {pid} for run {run_id} within {timeout}s")


def wait_ready(client: Any, node: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise RuntimeError(f"node exited with {node.returncode}; log:\n{log_path.read_text()[-3000:]}")
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"node not ready within {timeout}s; log:\n{log_path.read_text()[-3000:]}")


def node_log_problems(path: Path) -> list[str]:
    """Lines of the node log that look like errors or tracebacks."""
    out = []
    try:
        for line in path.read_text(errors="replace").splitlines():
            low = line.lower()
            if any(w in low for w in ("error", "traceback", "exception", "critical", "restart")):
                out.append(line.strip()[:300])
    except OSError:
        pass
    return out


def one_repeat(args: argparse.Namespace, scenario: str, pg: ThrowawayPostgres | None, index: int) -> dict[str, Any]:
    import httpx

    pull = scenario == "pull"
    tag = f"[{scenario} {index + 1}/{args.repeat}]"
    tmp = Path(_mkdtemp("ifrecov."))
    node: subprocess.Popen[bytes] | None = None
    workers: list[Worker] = []
    try:
        db = pg.new_database("recov") if args.backend == "postgres" and pg else str(tmp / "state" / "ironflow.db")
        api_key = None if args.timings == "dev" else mint_org_key(db)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        node_log = tmp / "node.log"
        cmd = [sys.executable, "-m", "ironflow", "serve", "--db", db, "--port", str(port),
               "--state-dir", str(tmp / "state"), "--node-id", f"recov-{index + 1}"]
        if args.timings == "dev":
            cmd.append("--dev")
        fh = open(node_log, "wb")
        try:
            node = subprocess.Popen(cmd, cwd=str(REPO), env=_env(), stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            fh.close()
        _LIVE.append(node)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=10.0) as client:
            wait_ready(client, node, node_log)
            effects = tmp / "effects.log"
            a = Worker(url, effects, tmp / "worker-a.log", pull=pull, slow=args.slow, api_key=api_key)
            workers.append(a)
            a.wait_ready()
            r = client.post("/v1/events", json={"name": "crash.go", "data": {}})
            r.raise_for_status()
            run_ids = r.json()["run_ids"]
            if len(run_ids) != 1:
                raise RuntimeError(f"crash.go started {len(run_ids)} runs: {r.text}")
            run_id = run_ids[0]
            wait_effect(effects, run_id, "two-start", a.pid, timeout=30.0)
            b = Worker(url, effects, tmp / "worker-b.log", pull=pull, slow=args.slow, api_key=api_key)
            workers.append(b)
            b.wait_ready()
            lease_left = None
            if pull:
                d = client.get(f"/v1/runs/{run_id}").json()
                if d.get("lease") is None:
                    raise RuntimeError(f"run {run_id} holds no lease before the kill: {d}")
                lease_left = d["lease"]["expires_at"] - d["db_now"]
            killed_at = a.kill9()
            log(f"{tag} kill -9 worker A (pid {a.pid}); run {run_id}"
                + (f"; lease left {lease_left:.2f} s + grace {GRACE_S[args.timings]:g} s" if pull else ""))
            budget = (lease_left or 0.0) + LEASE_S[args.timings] + GRACE_S[args.timings] + 60.0
            deadline = time.monotonic() + budget
            next_progress = time.monotonic() + 10.0
            status = None
            detail: dict[str, Any] = {}
            while True:
                try:
                    detail = client.get(f"/v1/runs/{run_id}").json()
                    status = detail["run"]["status"]
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    log(f"{tag} poll error: {exc!r}")
                    status = None
                if status in ("completed", "failed", "cancelled"):
                    break
                if node.poll() is not None:
                    raise RuntimeError(f"node exited with {node.returncode}; log:\n"
                                       f"{node_log.read_text()[-3000:]}")
                now = time.monotonic()
                if now > deadline:
                    raise RuntimeError(f"run {run_id} not finished {budget:.0f}s after the kill: {detail}")
                if now >= next_progress:
                    next_progress += 10.0
                    why = detail.get("waiting_reason") if detail else None
                    lease = detail.get("lease") if detail else None
                    if lease and not why:
                        why = f"lease expires in {lease['expires_at'] - detail['db_now']:.1f} s"
                    log(f"{tag} +{time.time() - killed_at:5.1f}s after kill: run {status}"
                        + (f" ({why})" if why else ""))
                time.sleep(0.01)
            seen_done = time.time()
            run = detail["run"]
            audit = client.get("/v1/audit", params={"include": "data", "run_id": run_id}).json()["events"]
        recovered = [e for e in audit if e["type"] == "capacity.segment.recovered"]
        expired = [e for e in audit if e["type"] == "capacity.lease.expired"]
        resumed = find_effect(effects, run_id, "two-start", b.pid)
        rows = read_effects(effects)
        notes: list[str] = []
        if status != "completed":
            notes.append(f"run ended {status}: {run.get('error')}")
        if run.get("output") != {"pid": b.pid}:
            notes.append(f"output {run.get('output')} is not B's pid {b.pid}")
        if run.get("recovery_count") != 1:
            notes.append(f"recovery_count {run.get('recovery_count')}")
        n_one = sum(1 for r in rows if r[1] == run_id and r[2] == "one")
        if n_one != 1:
            notes.append(f"step one ran {n_one} times")
        if len(recovered) != 1 or len(expired) != 1:
            notes.append(f"audit: {len(expired)} lease.expired, {len(recovered)} segment.recovered")
        if resumed is None:
            notes.append("B never recorded two-start")
        result: dict[str, Any] = {
            "scenario": scenario,
            "repeat": index + 1,
            "backend": args.backend,
            "timings": args.timings,
            "run_id": run_id,
            "status": status,
            "recovery_count": run.get("recovery_count"),
            "killed_at": killed_at,
            "lease_expired_s": (expired[0]["at"] - killed_at) if expired else None,
            "recovered_s": (recovered[0]["at"] - killed_at) if recovered else None,
            "resumed_s": (resumed[0] - killed_at) if resumed else None,
            "completed_s": (run["ended_at"] - killed_at) if run.get("ended_at") else None,
            "completion_seen_s": seen_done - killed_at,
            "notes": notes,
        }
        if pull:
            result["lease_left_s"] = lease_left
            result["grace_s"] = GRACE_S[args.timings]
            result["overhead_s"] = (result["resumed_s"] - (lease_left + GRACE_S[args.timings])
                                    if result["resumed_s"] is not None and lease_left is not None else None)
        for w in workers:
            w.stop()
        workers.clear()
        _stop(node)
        node = None
        problems = node_log_problems(node_log)
        if problems:
            result["node_log_problems"] = problems[:20]
        return result
    finally:
        for w in workers:
            w.stop()
        _stop(node)
        if args.keep:
            log(f"kept {tmp}")
            _TEMPS.remove(str(tmp))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            if str(tmp) in _TEMPS:
                _TEMPS.remove(str(tmp))


# ═══════════════════════════════════════════════════════════════════════════
# reporting
# ═══════════════════════════════════════════════════════════════════════════

COLUMNS = {
    "streaming": [
        ("(1) kill→recovered s", "recovered_s", "{:.3f}"),
        ("(2) kill→resumed s", "resumed_s", "{:.3f}"),
        ("(3) kill→completed s", "completed_s", "{:.3f}"),
    ],
    "pull": [
        ("lease left s", "lease_left_s", "{:.2f}"),
        ("(1) kill→recovered s", "recovered_s", "{:.3f}"),
        ("(2) kill→resumed s", "resumed_s", "{:.3f}"),
        ("(3) kill→completed s", "completed_s", "{:.3f}"),
        ("(2)-(left+grace) s", "overhead_s", "{:.3f}"),
    ],
}


def median_row(scenario: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[str, Any] = {}
    for _, key, _ in COLUMNS[scenario]:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        med[key] = statistics.median(vals) if vals else None
    return med


def print_table(scenario: str, rows: list[dict[str, Any]], med: dict[str, Any], args: argparse.Namespace) -> None:
    grace = GRACE_S[args.timings]
    print(f"\n{scenario} workers, {args.backend}, {args.timings} timings "
          f"(lease {LEASE_S[args.timings]:g} s, recovery grace {grace:g} s), {len(rows)} repeats")
    cols = COLUMNS[scenario]
    heads = ["repeat"] + [h for h, _, _ in cols]
    widths = [max(8, len(h)) for h in heads]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    table = [*((str(r["repeat"]), r) for r in rows), ("median", med),
             ("seed", {"recovered_s": SEED["recovered_s"], "completed_s": SEED["completed_s"]})]
    for label, row in table:
        cells = [label] + [fmt.format(row[k]) if row.get(k) is not None else "-" for _, k, fmt in cols]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    if scenario == "streaming":
        ok = med.get("resumed_s") is not None and med["resumed_s"] <= 0.5
        print(f"target (2) ≤ 0.5 s: median {med.get('resumed_s') or float('nan'):.3f} s "
              f"{'met' if ok else 'NOT met'}" + ("" if args.timings == "default" else " (target is for default timings)"))
    else:
        ok = med.get("overhead_s") is not None and med["overhead_s"] <= 1.0
        print(f"target (2)-(lease left+grace) ≤ 1 s: median {med.get('overhead_s') or float('nan'):.3f} s "
              f"{'met' if ok else 'NOT met'}")
    print("seed: 115 s kill -9 → recovery audit pair, 148 s → run completed (original product, --dev SQLite)")
    for r in rows:
        for n in r.get("notes", []):
            print(f"  repeat {r['repeat']}: {n}")
        for p in r.get("node_log_problems", []):
            print(f"  repeat {r['repeat']} node log: {p}")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    scenarios = ["streaming", "pull"] if args.scenario == "all" else [args.scenario]
    report: dict[str, Any] = {
        "config": {"scenarios": scenarios, "repeat": args.repeat, "timings": args.timings,
                   "backend": args.backend, "slow_s": args.slow, "lease_expiry_s": LEASE_S[args.timings],
                   "recovery_grace_s": GRACE_S[args.timings], "python": sys.version.split()[0]},
        "seed": SEED,
        "scenarios": {},
    }
    pg: ThrowawayPostgres | None = None
    try:
        if args.backend == "postgres":
            pg = ThrowawayPostgres()
            pg.start()
            _TEMPS.append(pg.base_dir)  # also removed by _cleanup_all() on a signal
        for scenario in scenarios:
            rows = []
            for i in range(args.repeat):
                log(f"[{scenario} {i + 1}/{args.repeat}] starting node and worker A "
                    f"({args.backend}, {args.timings} timings)")
                row = one_repeat(args, scenario, pg, i)
                log(f"[{scenario} {i + 1}/{args.repeat}] done: "
                    + ", ".join(f"{k} {row[k]:.3f}" for _, k, _ in COLUMNS[scenario]
                                if row.get(k) is not None))
                rows.append(row)
            med = median_row(scenario, rows)
            report["scenarios"][scenario] = {"repeats": rows, "median": med}
            if not args.json:
                print_table(scenario, rows, med, args)
                sys.stdout.flush()
    finally:
        if pg is not None:
            pg.stop()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--scenario", choices=["streaming", "pull", "all"], default="all")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timings", choices=["default", "dev"], default="default")
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--slow", type=float, default=600.0, help="crash_worker --slow (first executor of step two)")
    ap.add_argument("--keep", action="store_true", help="keep temp dirs (node and worker logs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    try:
        report = bench(args)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        _cleanup_all()
        sys.exit(130)
    finally:
        _cleanup_all()
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
