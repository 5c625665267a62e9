#!/usr/bin/env python
"""Throughput and latency benchmark of an Ironflow node with one streaming worker.

    python scripts/bench.py [--runs 1000] [--repeat 3] [--backend sqlite|postgres|both]
                            [--concurrency 50] [--inflight 32] [--json] [--profile]
                            [--nodes 1] [--node-processes 1] [--workers 1]
                            [--dashboards N]
    python scripts/bench.py --wake 1000 [--backend …] [--nodes K] [--repeat R]

``--wake N`` measures wake-up lateness instead (``wake_at`` → handler
resumed, for N sleeps due at the same instant; see ``scripts/wake_bench.py``,
which it runs with ``--backend``, ``--nodes``, ``--repeat``, ``--wake-lead``
and ``--wake-slots``).

For each repeat a FRESH node is started as a subprocess (``python -m
ironflow serve --dev`` on a free port, with a fresh temp state dir and SQLite
file, or a fresh database on a throwaway PostgreSQL cluster that this script
starts and stops itself), then ONE worker subprocess (this script re-invoked
with the hidden ``--worker`` flag: a ``StreamingWorker`` with
``max_concurrent_jobs=--concurrency`` serving a function of three trivial
``ctx.step.run`` steps). The worker streams, per run, the wall-clock time its
handler first started and how long each ``ctx.step.run`` call took into a
JSON-lines file.

Each repeat has two phases:

* idle: ``--idle-events`` (50) events emitted one at a time, ``--idle-gap``
  (50 ms) apart, the worker otherwise idle. Its emit→handler-start p50 is the
  figure the target "emit→start p50 ≤ 10 ms" refers to.
* latency (after the loaded phase): ``--latency`` (100) one-step runs, one at
  a time: emit sent → the run first read back ``completed`` (GET polled back
  to back: an upper bound by one GET round trip).
* loaded: ``--runs`` events emitted over HTTP with at most ``--inflight``
  requests in flight; wait until every run is ``completed``.

Reported per repeat and as the MEDIAN over repeats: runs/s and steps/s
(runs × 3 steps / (last run's ``ended_at`` − first emit's send time)),
emit→handler-start p50/p99 (handler start − emit request send time, per
run), ``ctx.step.run`` round trip p50, and the peak RSS (``VmHWM``) of the
node and of the worker, read just before they are stopped.

``--profile`` adds one extra, unreported repeat (first backend) with
``py-spy`` attached to the node and the worker during the loaded phase and
prints their hotspots (own time and inclusive time per function).

``--node-processes N`` (PostgreSQL) starts each node as ``ironflow serve
--processes N``: N node processes on one port; node CPU and peak RSS are
then summed (RSS: the largest) over the parent and its node processes.
``--workers W`` starts W worker processes per node URL, each with
``--concurrency`` slots (the kernel spreads their sockets over the node
processes; ``worker_sessions_by_node`` in the JSON says where they landed).
``load1`` is the 1-minute load average at the end of the loaded phase.

``--dashboards N`` keeps N windows of the node's dashboard (runs view, live)
open in one headless Chromium during every repeat, to measure what open
dashboards cost the node (compare ``node CPU s`` with and without).

Nothing here is hard-coded: every figure printed is measured by this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ironflow.testing import ThrowawayPostgres  # noqa: E402  (needs REPO on sys.path)

STEPS_PER_RUN = 3
LOAD_EVENT = "bench.load"
IDLE_EVENT = "bench.idle"
LOAD_FN = "bench-load"
IDLE_FN = "bench-idle"
LAT_EVENT = "bench.latency"
LAT_FN = "bench-latency"
# ``--flow``: the load function with one flow control (docs/flow-control.md), keyed
# per event so every event still starts its own run at once: what the mechanism's
# bookkeeping costs a run, not what it saves by skipping, batching or holding.
# Ingest side: rate_limit … batch; dispatch side: concurrency (layered: 1,000 in
# all, 1 per key), throttle, priority (half the runs 60 s ahead); on_limit: a limit
# of 1 per key with on_limit="skip" (its count at ingest).
FLOW_CHOICES = ("none", "rate_limit", "debounce", "singleton", "batch",
                "concurrency", "throttle", "priority", "on_limit")


def _flow_kwargs(flow: str) -> dict[str, Any]:
    import ironflow

    key = "event.data.i"
    return {
        "none": {},
        "rate_limit": {"rate_limit": ironflow.RateLimit(1_000_000, "1s", key=key)},
        "debounce": {"debounce": ironflow.Debounce("1s", key=key)},
        "singleton": {"singleton": ironflow.Singleton(key=key)},
        "batch": {"batch": ironflow.Batch(1, "1s", key=key)},
        "concurrency": {"concurrency": [{"limit": 1000}, {"limit": 1, "key": key}]},
        "throttle": {"throttle": ironflow.Throttle(1000, "1s", key=key)},
        "priority": {"priority": "event.data.i % 2 == 0 ? 60 : 0"},
        "on_limit": {"concurrency": ironflow.Concurrency(1, key=key, on_limit="skip")},
    }[flow]


# ═══════════════════════════════════════════════════════════════════════════
# worker mode (a subprocess)
# ═══════════════════════════════════════════════════════════════════════════


def worker_main(server: str, out: str, concurrency: int, loop: str, flow: str = "none") -> None:
    """The worker process: serve the bench functions on ``loop`` (asyncio | trio)."""
    import anyio

    import ironflow

    pending: list[dict[str, Any]] = []
    first_start: dict[str, float] = {}

    async def trivial(i: int) -> dict[str, Any]:
        return {"i": i, "ok": True}

    async def body(ctx: Any) -> dict[str, Any]:
        started = time.time()
        run_id = ctx.run.id
        first = first_start.setdefault(run_id, started)
        rtts = []
        step_ends = []
        for i in range(STEPS_PER_RUN):
            t0 = time.perf_counter()
            await ctx.step.run(f"s{i}", trivial, i)
            rtts.append(time.perf_counter() - t0)
            step_ends.append(time.time())  # StepCompleted is on its way to the engine
        pending.append(
            {"run": run_id, "fn": ctx.run.function_id, "start": first, "segment_start": started,
             "end": time.time(), "steps": rtts, "step_ends": step_ends}
        )
        return {"ok": True}

    @ironflow.function(LOAD_FN, triggers=[ironflow.event(LOAD_EVENT)], **_flow_kwargs(flow))
    async def bench_load(ctx: Any) -> dict[str, Any]:
        return await body(ctx)

    @ironflow.function(IDLE_FN, triggers=[ironflow.event(IDLE_EVENT)])
    async def bench_idle(ctx: Any) -> dict[str, Any]:
        return await body(ctx)

    @ironflow.function(LAT_FN, triggers=[ironflow.event(LAT_EVENT)])
    async def bench_latency(ctx: Any) -> dict[str, Any]:
        return await ctx.step.run("a", trivial, 0)

    fh = open(out, "a", buffering=1)

    def flush() -> None:
        if pending:
            fh.write("".join(json.dumps(r) + "\n" for r in pending))
            pending.clear()
            fh.flush()

    async def flusher() -> None:
        while True:
            await anyio.sleep(0.1)
            flush()

    async def main() -> None:
        worker = ironflow.StreamingWorker(
            server, [bench_load, bench_idle, bench_latency], max_concurrent_jobs=concurrency,
            drain_timeout=10.0, reconnect_delay=0.5, handle_signals=True,
        )
        async with anyio.create_task_group() as nursery:
            await nursery.start(worker.run)
            fh.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
            fh.flush()
            nursery.start_soon(flusher)
            await worker._finished.wait()
            nursery.cancel_scope.cancel()

    try:
        if loop == "trio":
            import trio

            trio.run(main)
        elif loop == "uvloop":
            import uvloop

            uvloop.run(main())
        else:
            asyncio.run(main())
    finally:
        flush()
        fh.close()


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


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")
    try:
        p = subprocess.Popen(cmd, cwd=str(REPO), env=_env(), stdout=fh, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        fh.close()
    _LIVE.append(p)
    return p


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _open_dashboards(url: str, count: int) -> Any:
    """``count`` windows of the node's dashboard (runs view) in one headless
    Chromium, each polling the node as a user's open page would; returns the
    Selenium driver (``quit()`` closes them all)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    for i in range(count):
        if i:
            driver.switch_to.new_window("window")
        driver.get(url + "/#/runs")
    hidden = 0  # a hidden page stops polling: say so rather than measure nothing
    for handle in driver.window_handles:
        driver.switch_to.window(handle)
        hidden += bool(driver.execute_script("return document.hidden"))
    if hidden:
        print(f"warning: {hidden} of {count} dashboard windows are hidden and do not poll", file=sys.stderr)
    return driver


def _main_thread_cpu_s(pid: int) -> float:
    """utime + stime of ``pid``'s main thread alone (the node's Trio thread)."""
    return _cpu_s(pid, f"/proc/{pid}/task/{pid}/stat")


def _pg_server_cpu_s(pg: ThrowawayPostgres | None) -> float:
    """CPU seconds of the throwaway PostgreSQL's postmaster and its live children
    (backends, WAL writer…); a backend that already exited is not counted."""
    if pg is None or not pg.base_dir:
        return float("nan")
    try:
        with open(f"{pg.base_dir}/data/postmaster.pid") as fh:
            postmaster = int(fh.readline())
    except (OSError, ValueError):
        return float("nan")
    total = _cpu_s(postmaster)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == postmaster:
                total += _cpu_s(int(entry))
    return total


def _with_children(pid: int) -> list[int]:
    """``pid`` and its live children (the node processes of ``serve --processes N``)."""
    pids = [pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def _cpu_all(nodes: list[subprocess.Popen[bytes]],
             workers: list[subprocess.Popen[bytes]]) -> tuple[float, float, float, float]:
    """CPU seconds so far: all nodes (with their node processes), all workers, this
    script, the nodes' main threads."""
    node_pids = [pid for n in nodes for pid in _with_children(n.pid)]
    return (sum(_cpu_s(pid) for pid in node_pids), sum(_cpu_s(w.pid) for w in workers),
            time.process_time(), sum(_main_thread_cpu_s(pid) for pid in node_pids))


def _cpu_s(pid: int, stat: str = "") -> float:
    """utime + stime of ``pid`` in seconds (all its threads)."""
    try:
        with open(stat or f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# ═══════════════════════════════════════════════════════════════════════════
# measurement
# ═══════════════════════════════════════════════════════════════════════════


def _pg_counters(db_url: str, reset: bool) -> dict[str, Any]:
    """Transactions committed in ``db_url``'s database and statements executed in it
    (pg_stat_statements, BEGIN/COMMIT/SAVEPOINT included), optionally resetting the latter."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        if reset:
            conn.execute("SELECT pg_stat_statements_reset()")
        xacts = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database"
                             " WHERE datname = current_database()").fetchone()
        rows = conn.execute(
            "SELECT calls, round((total_exec_time + total_plan_time)::numeric, 1),"
            " left(regexp_replace(query, '\\s+', ' ', 'g'), 90) FROM pg_stat_statements"
            " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " ORDER BY total_exec_time + total_plan_time DESC").fetchall()
    return {"xacts": int(xacts[0]) if xacts else 0,
            "statements": sum(int(c) for c, _, _ in rows),
            "top": [[int(c), float(ms), q] for c, ms, q in rows[:40]]}


def _sessions_by_node(db_url: str) -> dict[str, int]:
    """Live worker sessions per node id (where the kernel put each worker's socket)."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute("SELECT node_id, count(*) FROM worker_sessions GROUP BY node_id"
                            " ORDER BY node_id").fetchall()
    return {str(node): int(n) for node, n in rows}


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def _read_records(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a partially written last line
    return out


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"node exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
            try:
                r = await c.get(f"{url}/readyz")
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"node not ready within {timeout}s; log:\n{log.read_text()[-3000:]}")


async def _wait_worker_ready(out: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        if any(r.get("ready") for r in _read_records(out)):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"worker not ready within {timeout}s; log:\n{log.read_text()[-3000:]}")


def _started(answer: dict[str, Any]) -> list[str]:
    """The runs an emit started or holds (a debounced or batched run: ``--flow``)."""
    held = [note["run_id"] for note in answer.get("debounced", []) + answer.get("batched", [])]
    return list(answer["run_ids"]) + held


async def _emit(client: Any, url: str, name: str, i: int, sent: dict[str, float]) -> None:
    t = time.time()
    r = await client.post(f"{url}/v1/events", json={"name": name, "data": {"i": i}})
    r.raise_for_status()
    run_ids = _started(r.json())
    if len(run_ids) != 1:
        raise RuntimeError(f"emit {name} started {len(run_ids)} runs, expected 1: {r.text}")
    sent[run_ids[0]] = t


class _Response:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code = status
        self.body = body
        self.text = body.decode(errors="replace")

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError(f"HTTP {self.status_code}: {self.text[:300]}")

    def json(self) -> Any:
        return json.loads(self.body)


class _LoadClient:
    """The load generator's HTTP client: aiohttp, whose per-request CPU cost is a
    fraction of httpx's, so the 2 shared cores go to the engine being measured."""

    def __init__(self, inflight: int) -> None:
        self._inflight = inflight

    async def __aenter__(self) -> _LoadClient:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._inflight),
            timeout=aiohttp.ClientTimeout(total=60.0),
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._session.close()

    async def post(self, url: str, json: Any = None) -> _Response:
        async with self._session.post(url, json=json) as r:
            return _Response(r.status, await r.read())

    async def get(self, url: str, params: dict[str, Any] | None = None) -> _Response:
        async with self._session.get(url, params=params) as r:
            return _Response(r.status, await r.read())


async def _emit_batch(client: Any, url: str, name: str, first: int, count: int,
                      sent: dict[str, float]) -> None:
    t = time.time()
    events = [{"name": name, "data": {"i": i}} for i in range(first, first + count)]
    r = await client.post(f"{url}/v1/events/batch", json={"events": events})
    r.raise_for_status()
    for result in r.json()["events"]:
        run_ids = _started(result)
        if len(run_ids) != 1:
            raise RuntimeError(f"emit {name} started {len(run_ids)} runs, expected 1")
        sent[run_ids[0]] = t


async def _step_commit_latency(client: Any, url: str, run_ids: list[str],
                               by_run: dict[str, dict[str, Any]]) -> list[float]:
    """Per step: engine commit time (step row created_at, DB clock = this host's clock)
    minus the worker's wall-clock time when the step finished and was reported."""
    out: list[float] = []
    for rid in run_ids:
        r = await client.get(f"{url}/v1/runs/{rid}")
        r.raise_for_status()
        steps = sorted(r.json()["steps"], key=lambda st: st["name"])
        for st, end in zip(steps, by_run[rid]["step_ends"], strict=True):
            out.append((float(st["created_at"]) - end) * 1000.0)
    return out


def _read_all(outs: list[Path]) -> list[dict[str, Any]]:
    return [r for out in outs for r in _read_records(out)]


async def _wait_done(client: Any, url: str, outs: list[Path], fn: str, n: int, timeout: float,
                     procs: list[subprocess.Popen[bytes]],
                     settled: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Wait until the worker reported ``n`` handlers of ``fn`` done, then until the
    engine shows no run of ``fn`` in any status but completed; call ``settled``
    then (before the listing below, whose cost is the benchmark's, not the
    runs'); return the (newest ≤ 1000) completed RunRecords."""
    deadline = time.monotonic() + timeout
    while True:
        done = sum(1 for r in _read_all(outs) if r.get("fn") == fn)
        if done >= n:
            break
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode} after {done}/{n} runs")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {done}/{n} {fn} handlers finished within {timeout}s")
        await asyncio.sleep(0.1)
    # The API lists at most 1000 runs, newest first: check that no run of ``fn`` is
    # left in any other status, then fetch the (newest ≤ 1000) completed ones.
    others = ("waiting_for_capacity", "running", "waiting", "failed", "cancelled")
    while True:
        left = 0
        for status in others:
            r = await client.get(f"{url}/v1/runs", params={"status": status, "function": fn, "limit": 1})
            r.raise_for_status()
            left += len(r.json()["runs"])
            if status in ("failed", "cancelled") and r.json()["runs"]:
                raise RuntimeError(f"a {fn} run ended {status}: {r.json()['runs'][0]}")
        if left == 0:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{fn}: {left} runs not completed within {timeout}s")
        await asyncio.sleep(0.25)
    if settled is not None:
        settled()
    r = await client.get(f"{url}/v1/runs", params={"status": "completed", "function": fn,
                                                   "limit": min(n, 1000)})
    r.raise_for_status()
    runs: list[dict[str, Any]] = r.json()["runs"]
    if len(runs) < min(n, 1000):
        raise RuntimeError(f"{fn}: {len(runs)} completed runs listed, {min(n, 1000)} expected")
    return runs


async def _latency_phase(client: Any, url: str, n: int, timeout: float) -> list[float]:
    """``n`` one-step runs one after another: ms from sending the emit to the first
    GET of the run that shows it ``completed`` (polled back to back, so an upper
    bound by at most one GET round trip)."""
    out: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        r = await client.post(f"{url}/v1/events", json={"name": LAT_EVENT, "data": {"i": i}})
        r.raise_for_status()
        (run_id,) = r.json()["run_ids"]
        while True:
            r = await client.get(f"{url}/v1/runs/{run_id}")
            r.raise_for_status()
            status = r.json()["run"]["status"]
            if status == "completed":
                break
            if status in ("failed", "cancelled") or time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"latency run {run_id} ended {status}")
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


class Profiler:
    """py-spy attached to a pid, raw (collapsed) output."""

    def __init__(self, pid: int, out: Path, log: Path) -> None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.out = out
        self.proc = _spawn([spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                            "--nonblocking", "--threads", "-o", str(out)], log)

    def stop(self) -> None:
        _stop(self.proc, sig=signal.SIGINT, grace=30.0)


async def one_repeat(args: argparse.Namespace, backend: str, pg: ThrowawayPostgres | None,
                     profile: bool = False) -> dict[str, Any]:

    tmp = Path(_mkdtemp("ifbench."))
    nodes: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[bytes]] = []
    dashboards: Any = None
    profilers: dict[str, Profiler] = {}
    try:
        db = pg.new_database("bench") if backend == "postgres" and pg else str(tmp / "state" / "ironflow.db")
        # Several nodes share one PostgreSQL database, each with its own worker; emits
        # go to the nodes in turn.
        urls: list[str] = []
        outs: list[Path] = []
        for k in range(args.nodes if backend == "postgres" else 1):
            port = _free_port()
            urls.append(f"http://127.0.0.1:{port}")
            node_log = tmp / f"node{k}.log"
            processes = ["--processes", str(args.node_processes)] if args.node_processes > 1 else []
            nodes.append(_spawn([sys.executable, "-m", "ironflow", "serve", "--dev", "--port", str(port),
                                 "--db", db, "--state-dir", str(tmp / f"state{k}"),
                                 "--log-level", args.node_log_level, *processes], node_log))
            await _wait_ready(urls[k], nodes[k], node_log)
        for k, node_url in enumerate(u for u in urls for _ in range(args.workers)):
            outs.append(tmp / f"worker{k}.jsonl")
            worker_log = tmp / f"worker{k}.log"
            workers.append(_spawn([sys.executable, str(Path(__file__).resolve()), "--worker",
                                   "--server", node_url, "--out", str(outs[k]),
                                   "--concurrency", str(args.concurrency),
                                   "--worker-loop", args.worker_loop, "--flow", args.flow], worker_log))
            await _wait_worker_ready(outs[k], workers[k], worker_log)
        url, node, worker = urls[0], nodes[0], workers[0]
        if args.dashboards:
            dashboards = _open_dashboards(url, args.dashboards)

        async with _LoadClient(args.inflight) as client:
            # ── idle phase: one event at a time, the worker otherwise idle ──
            idle_sent: dict[str, float] = {}
            for i in range(args.idle_events):
                await _emit(client, url, IDLE_EVENT, i, idle_sent)
                await asyncio.sleep(args.idle_gap)
            await _wait_done(client, url, outs, IDLE_FN, args.idle_events, args.timeout, workers)

            # ── loaded phase ──
            if profile:
                profilers["node"] = Profiler(node.pid, tmp / "node.prof", tmp / "spy-node.log")
                profilers["worker"] = Profiler(worker.pid, tmp / "worker.prof", tmp / "spy-worker.log")
                await asyncio.sleep(1.0)  # let py-spy attach
            pg0 = _pg_counters(db, reset=True) if backend == "postgres" else None
            sent: dict[str, float] = {}
            sem = asyncio.Semaphore(args.inflight)
            cpu0 = _cpu_all(nodes, workers)
            pg_cpu0 = _pg_server_cpu_s(pg if backend == "postgres" else None)

            batch = max(1, args.emit_batch)

            async def bounded(i: int) -> None:
                async with sem:
                    if batch == 1:
                        await _emit(client, urls[i % len(urls)], LOAD_EVENT, i, sent)
                    else:
                        await _emit_batch(client, urls[(i // batch) % len(urls)], LOAD_EVENT, i,
                                          min(batch, args.runs - i), sent)

            await asyncio.gather(*(bounded(i) for i in range(0, args.runs, batch)))
            emits_done = time.time()
            marks: dict[str, Any] = {}

            def settled() -> None:  # every run completed: the loaded phase's CPU ends here
                marks["cpu"] = _cpu_all(nodes, workers)
                marks["pg_cpu"] = _pg_server_cpu_s(pg if backend == "postgres" else None)

            runs = await _wait_done(client, url, outs, LOAD_FN, args.runs, args.timeout, workers, settled)
            cpu1, pg_cpu1 = marks["cpu"], marks["pg_cpu"]
            # The node's CPU for the listing of the completed runs just read (the
            # benchmark's own check, outside the figures above).
            cpu_listing = _cpu_all(nodes, workers)[0] - cpu1[0]
            load1 = os.getloadavg()[0]
            pg1 = _pg_counters(db, reset=False) if pg0 is not None else None
            sample = sorted(sent)[:: max(1, len(sent) // 100)]
            by_run_now = {r["run"]: r for r in _read_all(outs) if "run" in r}
            commit_lat = await _step_commit_latency(client, url, sample, by_run_now)
            # ── latency phase: one-step runs, one at a time, the node otherwise idle ──
            one_step = await _latency_phase(client, url, args.latency, args.timeout)

        hwm_node = max((_vm_hwm_kib(pid) or 0) for n in nodes for pid in _with_children(n.pid))
        sessions_by_node = _sessions_by_node(db) if backend == "postgres" else None
        hwm_worker = max((_vm_hwm_kib(w.pid) or 0) for w in workers)
        for p in profilers.values():
            p.stop()
        workers_started = workers
        for proc in workers + nodes:
            _stop(proc)
        workers, nodes = [], []

        records = _read_all(outs)
        by_run = {r["run"]: r for r in records if "run" in r}
        load_runs = [r for r in runs if r["id"] in sent]
        if len(load_runs) != min(args.runs, 1000):
            raise RuntimeError(f"{len(load_runs)} of {args.runs} emitted runs listed completed")
        missing = [rid for rid in sent if rid not in by_run]
        if missing:
            raise RuntimeError(f"{len(missing)} runs never reached the worker's handler")
        first_emit = min(sent.values())
        # Last completion: the engine's ended_at (exact when runs ≤ 1000, the API's list
        # limit); the worker's handler-return times are a lower bound for the rest.
        last_end = max(max(float(r["ended_at"]) for r in load_runs),
                       max(by_run[rid]["end"] for rid in sent))
        wall = last_end - first_emit
        lat = [(by_run[rid]["start"] - t) * 1000.0 for rid, t in sent.items()]
        idle_lat = [(by_run[rid]["start"] - t) * 1000.0 for rid, t in idle_sent.items()]
        step_rtt = [s * 1000.0 for rid in sent for s in by_run[rid]["steps"]]
        replays = sum(1 for rid in sent if by_run[rid]["segment_start"] != by_run[rid]["start"])
        result: dict[str, Any] = {
            "backend": backend,
            "nodes": len(urls),
            "node_processes": args.node_processes if backend == "postgres" else 1,
            "workers": len(workers_started),
            "worker_sessions_by_node": sessions_by_node,
            "load1": load1,
            "runs": args.runs,
            "wall_s": wall,
            "emit_phase_s": emits_done - first_emit,
            "runs_per_s": args.runs / wall,
            "steps_per_s": args.runs * STEPS_PER_RUN / wall,
            "emit_start_p50_ms": pct(lat, 50),
            "emit_start_p99_ms": pct(lat, 99),
            "idle_emit_start_p50_ms": pct(idle_lat, 50),
            "idle_emit_start_p99_ms": pct(idle_lat, 99),
            "step_rtt_p50_ms": pct(step_rtt, 50),
            "step_rtt_p99_ms": pct(step_rtt, 99),
            "step_commit_p50_ms": pct(commit_lat, 50),
            "step_commit_p99_ms": pct(commit_lat, 99),
            "emit_batch": batch,
            "one_step_p50_ms": pct(one_step, 50),
            "one_step_p99_ms": pct(one_step, 99),
            "node_peak_rss_mb": hwm_node / 1024.0 if hwm_node else None,
            "worker_peak_rss_mb": hwm_worker / 1024.0 if hwm_worker else None,
            "replayed_segments": replays,
            # CPU seconds used during the loaded phase (incl. the final completion polls)
            "cpu_node_s": cpu1[0] - cpu0[0],
            "cpu_worker_s": cpu1[1] - cpu0[1],
            "cpu_bench_client_s": cpu1[2] - cpu0[2],
            # of cpu_node_s: the node's main (Trio) thread; the rest is its database threads
            "cpu_node_main_thread_s": cpu1[3] - cpu0[3],
            "cpu_node_listing_s": cpu_listing,
            # PostgreSQL's processes during the loaded phase
            "cpu_pg_server_s": pg_cpu1 - pg_cpu0 if backend == "postgres" else None,
        }
        if pg0 is not None and pg1 is not None:
            # Our own two counter queries (and the completion polls) are included: a few per trial.
            result["pg_xacts_per_run"] = (pg1["xacts"] - pg0["xacts"]) / args.runs
            result["pg_statements_per_run"] = pg1["statements"] / args.runs
            result["pg_top_statements"] = pg1["top"]
        if profile:
            result["profile"] = {name: analyse_profile(p.out) for name, p in profilers.items()}
        return result
    finally:
        if dashboards is not None:
            dashboards.quit()
        for p in profilers.values():
            p.stop()
        for proc in workers + nodes:
            _stop(proc)
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
            _TEMPS.remove(str(tmp))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            if str(tmp) in _TEMPS:
                _TEMPS.remove(str(tmp))


# ── profile analysis (py-spy raw = collapsed stacks "f (file:line);g (...) count") ──


def _frame_key(frame: str) -> str:
    """'func (path/to/file.py:123)' → 'short/file.py:func'."""
    frame = frame.strip()
    if frame.endswith(")") and " (" in frame:
        func, loc = frame[:-1].rsplit(" (", 1)
        path = loc.rsplit(":", 1)[0]
        for marker in ("site-packages/", "/lib/python3"):
            if marker in path:
                path = path.split(marker, 1)[1]
                if marker == "/lib/python3":
                    path = "stdlib" + path.split("/", 1)[1][len(""):] if "/" in path else path
                break
        else:
            if path.startswith(str(REPO) + "/"):
                path = path[len(str(REPO)) + 1:]
        return f"{path}:{func}"
    return frame


def _package(key: str) -> str:
    path = key.split(":", 1)[0]
    if path.startswith("stdlib"):
        rest = path[len("stdlib"):].lstrip("./0123456789")
        return "stdlib:" + (rest.split("/", 1)[0].removesuffix(".py") or "?")
    return path.split("/", 1)[0].removesuffix(".py")


def analyse_profile(path: Path, top: int = 15) -> dict[str, Any]:
    if not path.exists():
        return {"error": "no profile written"}
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    pkg_own: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames and frames[0].startswith(("thread (", "process ")):
            threads[frames[0]] += n
            frames = [f for f in frames[1:] if not f.startswith(("thread (", "process "))]
        if not frames:
            continue
        keys = [_frame_key(f) for f in frames]
        total += n
        own[keys[-1]] += n
        pkg_own[_package(keys[-1])] += n
        for k in set(keys):
            incl[k] += n
        _ = defaultdict
    if not total:
        return {"error": "empty profile"}

    def share(c: Counter[str], k: int) -> list[list[Any]]:
        return [[name, round(100.0 * v / total, 1)] for name, v in c.most_common(k)]

    proj = Counter({k: v for k, v in incl.items() if k.startswith(("ironflow/", "actors/"))})
    return {
        "samples": total,
        "threads": share(threads, 6),
        "own": share(own, top),
        "by_package_own": share(pkg_own, 12),
        "inclusive_project": share(proj, top),
    }


# ═══════════════════════════════════════════════════════════════════════════
# reporting
# ═══════════════════════════════════════════════════════════════════════════

COLUMNS = [
    ("runs/s", "runs_per_s", "{:.0f}"),
    ("steps/s", "steps_per_s", "{:.0f}"),
    ("wall s", "wall_s", "{:.2f}"),
    ("emit s", "emit_phase_s", "{:.2f}"),
    ("1-step p50 ms", "one_step_p50_ms", "{:.1f}"),
    ("1-step p99 ms", "one_step_p99_ms", "{:.1f}"),
    ("e→s p50 ms", "emit_start_p50_ms", "{:.1f}"),
    ("e→s p99 ms", "emit_start_p99_ms", "{:.1f}"),
    ("idle e→s p50", "idle_emit_start_p50_ms", "{:.2f}"),
    ("idle e→s p99", "idle_emit_start_p99_ms", "{:.2f}"),
    ("step→commit p50 ms", "step_commit_p50_ms", "{:.2f}"),
    ("node RSS MB", "node_peak_rss_mb", "{:.0f}"),
    ("wrk RSS MB", "worker_peak_rss_mb", "{:.0f}"),
    ("node CPU s", "cpu_node_s", "{:.2f}"),
    ("node main thr CPU s", "cpu_node_main_thread_s", "{:.2f}"),
    ("wrk CPU s", "cpu_worker_s", "{:.2f}"),
    ("emitter CPU s", "cpu_bench_client_s", "{:.2f}"),
    ("PG server CPU s", "cpu_pg_server_s", "{:.2f}"),
    ("load1", "load1", "{:.2f}"),
    ("PG xacts/run", "pg_xacts_per_run", "{:.1f}"),
    ("PG stmts/run", "pg_statements_per_run", "{:.1f}"),
]


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[str, Any] = {}
    for _, key, _ in COLUMNS:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        med[key] = statistics.median(vals) if vals else None
    return med


def print_table(backend: str, rows: list[dict[str, Any]], med: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{backend}: {args.runs} runs × {STEPS_PER_RUN} steps, worker max_concurrent_jobs="
          f"{args.concurrency}, {args.inflight} emits in flight, idle: {args.idle_events} emits "
          f"{args.idle_gap * 1000:.0f} ms apart")
    heads = ["repeat"] + [h for h, _, _ in COLUMNS]
    widths = [max(6, len(h)) for h in heads]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    for label, row in [*((str(i + 1), r) for i, r in enumerate(rows)), ("median", med)]:
        cells = [label] + [fmt.format(row[k]) if row.get(k) is not None else "-" for _, k, fmt in COLUMNS]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))


def print_profile(prof: dict[str, Any]) -> None:
    for name, p in prof.items():
        if "error" in p:
            print(f"\nprofile {name}: {p['error']}")
            continue
        print(f"\nprofile of the {name} during the loaded phase ({p['samples']} samples, py-spy):")
        print("  threads: " + ", ".join(f"{t} {s}%" for t, s in p["threads"]))
        print("  own time by package: " + ", ".join(f"{k} {s}%" for k, s in p["by_package_own"]))
        print("  own time, top functions:")
        for k, s in p["own"]:
            print(f"    {s:5.1f}%  {k}")
        print("  inclusive time, project functions:")
        for k, s in p["inclusive_project"]:
            print(f"    {s:5.1f}%  {k}")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    report: dict[str, Any] = {
        "config": {"runs": args.runs, "repeat": args.repeat, "concurrency": args.concurrency,
                   "inflight": args.inflight, "steps_per_run": STEPS_PER_RUN, "nodes": args.nodes,
                   "node_processes": args.node_processes, "workers": args.workers,
                   "idle_events": args.idle_events, "idle_gap_s": args.idle_gap,
                   "cpus": os.cpu_count(), "python": sys.version.split()[0],
                   "worker_loop": args.worker_loop, "flow": args.flow},
        "backends": {},
    }
    pg: ThrowawayPostgres | None = None
    try:
        if "postgres" in backends:
            # PostgreSQL's default durability (fsync, synchronous_commit on): never
            # the test fixture's fsync=off for a figure.
            # pg_stat_statements counts the statements (round trips) per run.
            pg = ThrowawayPostgres(
                durable=True, server_options="-c shared_preload_libraries=pg_stat_statements"
                " -c pg_stat_statements.track_planning=on")
            pg.start()
            _TEMPS.append(pg.base_dir)  # also removed by _cleanup_all() on a signal
        for backend in backends:
            rows = []
            for i in range(args.repeat):
                if not args.json:
                    print(f"[{backend}] repeat {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
                rows.append(await one_repeat(args, backend, pg))
            med = median_row(rows)
            report["backends"][backend] = {"repeats": rows, "median": med}
            if not args.json:
                print_table(backend, rows, med, args)
                if rows[-1].get("pg_top_statements"):
                    print("statements in the last repeat's loaded phase, most server time"
                          " (plan + execute) first: calls, total ms, query")
                    for calls, ms, query in rows[-1]["pg_top_statements"]:
                        print(f"  {calls:7d} {ms:9.1f}  {query}")
        if args.profile:
            backend = backends[0]
            if not args.json:
                print(f"\n[{backend}] profiled repeat (not counted above) ...", file=sys.stderr, flush=True)
            prow = await one_repeat(args, backend, pg, profile=True)
            report["profile"] = {"backend": backend, "figures_under_profiler": {
                k: v for k, v in prow.items() if k != "profile"}, **prow["profile"]}
            if not args.json:
                print_profile(prow["profile"])
    finally:
        if pg is not None:
            pg.stop()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="sqlite")
    ap.add_argument("--concurrency", type=int, default=50, help="worker max_concurrent_jobs")
    ap.add_argument("--nodes", type=int, default=1,
                    help="PostgreSQL only: nodes sharing the database, one worker each")
    ap.add_argument("--node-processes", type=int, default=1,
                    help="PostgreSQL only: each node is `ironflow serve --processes N`")
    ap.add_argument("--workers", type=int, default=1,
                    help="worker processes per node URL, each with --concurrency slots")
    ap.add_argument("--inflight", type=int, default=32, help="emit requests in flight")
    ap.add_argument("--emit-batch", type=int, default=1,
                    help="events per request in the loaded phase (1: POST /v1/events each; "
                         "N>1: POST /v1/events/batch)")
    ap.add_argument("--idle-events", type=int, default=50)
    ap.add_argument("--latency", type=int, default=100,
                    help="one-step runs emitted one at a time after the loaded phase, "
                         "emit → seen completed")
    ap.add_argument("--idle-gap", type=float, default=0.05, help="seconds between idle emits")
    ap.add_argument("--timeout", type=float, default=300.0, help="per phase, seconds")
    ap.add_argument("--node-log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--profile", action="store_true", help="one extra repeat under py-spy")
    ap.add_argument("--keep", action="store_true", help="keep temp dirs (logs, profiles)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dashboards", type=int, default=0,
                    help="keep this many dashboard windows open (headless Chromium) during each repeat")
    ap.add_argument("--wake", type=int, default=0, metavar="N",
                    help="measure wake-up lateness of N sleeps due at once instead (scripts/wake_bench.py)")
    ap.add_argument("--wake-lead", type=float, default=6.0, help="--wake: seconds from the emits to the wake time")
    ap.add_argument("--wake-slots", type=int, default=None,
                    help="--wake: each worker's max_concurrent_jobs (default: N, one slot per sleep)")
    ap.add_argument("--worker-loop", choices=["asyncio", "trio", "uvloop"], default="asyncio",
                    help="the event loop the worker process runs on (uvloop: if installed)")
    ap.add_argument("--flow", choices=FLOW_CHOICES, default="none",
                    help="the load function with this flow control, keyed per event")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        worker_main(args.server, args.out, args.concurrency, args.worker_loop, args.flow)
        return
    if args.wake:
        import wake_bench

        wake_bench.run(args.wake, args.backend, args.nodes, args.repeat, args.wake_lead, args.wake_slots)
        return

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        report = asyncio.run(bench(args))
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        sys.exit(130)
    finally:
        _cleanup_all()
    if args.json:
        print(json.dumps(report, indent=None))


if __name__ == "__main__":
    main()
