#!/usr/bin/env python
"""History retention under sustained load: throughput, step→commit latency and
the database's size over time, with a retention of a few seconds and without.

    python scripts/retention_bench.py [--duration 180] [--retention 5s]
                                      [--janitor-interval 5s] [--order ABBA]
                                      [--idempotency-window SECONDS]

Each trial starts a FRESH ``--dev`` node on a fresh SQLite file and one
``bench.py`` worker process (three trivial steps per run, 50 slots; it writes
one JSON line per finished run: handler start and end, each step's end), then
keeps the node loaded for ``--duration`` seconds: events are emitted over
HTTP with at most ``--inflight`` requests in flight and at most
``--outstanding`` runs emitted but not yet reported done by the worker (a
closed loop, so the queue stays bounded and the figure is the throughput the
node sustains). Trial ``A`` runs with ``--history-retention 0`` (nothing is
deleted), trial ``B`` with ``--history-retention RETENTION --janitor-interval
INTERVAL``; ``--order`` says which trials run in which order (ABBA by
default, so slow drift of a shared machine hits both alike). Events are kept
for the idempotency window (24 h by default) whatever the retention, so a
run short of a day sees them grow unless ``--idempotency-window`` shortens it.

The janitor deletes runs a few seconds after they end, so nothing here reads
runs back late: throughput comes from the worker's own records (runs whose
handler returned inside the measured window, after ``--warmup`` seconds,
divided by the window), and step→commit from a sample of runs (1 in
``--sample-every``) read back through the API as soon as the worker reports
them — well inside the retention — as the step rows' ``created_at``
(database clock, this host's clock on SQLite) minus the worker's time when
that step ended. A sampled run already deleted is counted, not hidden.

Every ``--size-every`` seconds it records the database file, its WAL and the
number of rows in ``runs`` (read-only connection). Reported per trial:
runs/s, steps/s, step→commit p50/p99, the database size (file + WAL) at the
end of the warm-up and at the end, its growth over the measured window, the
rows deleted (the node's ``ironflow_history_rows_deleted_total``) and the
node's peak RSS; then the B/A ratios of the medians. ``--json`` prints the
whole report, size series included.

Nothing here is hard-coded: every figure printed is measured by this run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (scripts/ on sys.path)
from children import TEMPS, cleanup_all, free_port, mkdtemp, stop  # noqa: E402

MB = 1024 * 1024


class Tail:
    """New complete JSON lines of the worker's records file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a partly written last line waits for the next read
        self.offset += end
        return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]


def _sizes(db: Path) -> tuple[int, int, int]:
    """(database file bytes, WAL bytes, rows in ``runs``)."""
    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except FileNotFoundError:
            return 0

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0) as conn:
        runs = int(conn.execute("SELECT count(*) FROM runs").fetchone()[0])
    conn.close()
    return size(db), size(db.with_name(db.name + "-wal")), runs


async def _deleted_rows(client: Any, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ironflow_history_rows_deleted_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


async def _load(args: argparse.Namespace, client: Any, url: str, tail: Tail, db: Path,
                t0: float) -> dict[str, Any]:
    """Keep the node loaded until ``t0 + warmup + duration``; collect what we measure."""
    stop_at = t0 + args.warmup + args.duration
    emitted = 0
    done: dict[str, dict[str, Any]] = {}
    sampled: list[str] = []
    commit_ms: list[float] = []
    missed = 0
    sizes: list[dict[str, float]] = []
    slots = asyncio.Semaphore(args.inflight)
    room = asyncio.Event()
    room.set()
    failures: list[BaseException] = []

    def note_failure(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    async def emitter() -> None:
        nonlocal emitted
        pending: set[asyncio.Task[None]] = set()
        while time.time() < stop_at:
            if failures:
                raise RuntimeError(f"an emit failed: {failures[0]!r}")
            if emitted - len(done) >= args.outstanding:
                room.clear()
                await room.wait()
                continue
            await slots.acquire()
            emitted += 1
            task = asyncio.ensure_future(_emit_one(emitted))
            pending.add(task)
            task.add_done_callback(pending.discard)
            task.add_done_callback(note_failure)
        if pending:
            await asyncio.gather(*pending)

    async def _emit_one(i: int) -> None:
        try:
            r = await client.post(f"{url}/v1/events", json={"name": bench.LOAD_EVENT, "data": {"i": i}})
            r.raise_for_status()
        finally:
            slots.release()

    async def reader() -> None:
        nonlocal missed
        n = 0
        while time.time() < stop_at + 1.0:
            for rec in tail.read():
                if rec.get("fn") != bench.LOAD_FN:
                    continue
                done[rec["run"]] = rec
                n += 1
                if n % args.sample_every == 0:
                    sampled.append(rec["run"])
            room.set()
            later = []
            while sampled:
                rid = sampled.pop()
                r = await client.get(f"{url}/v1/runs/{rid}")
                if r.status_code == 404:
                    missed += 1  # deleted before we read it: counted, not hidden
                    continue
                r.raise_for_status()
                if r.json()["run"]["status"] != "completed":
                    later.append(rid)  # its last step result may still be on its way
                    continue
                steps = sorted(r.json()["steps"], key=lambda st: st["name"])
                for st, end in zip(steps, done[rid]["step_ends"], strict=True):
                    commit_ms.append((float(st["created_at"]) - end) * 1000.0)
            sampled.extend(later)
            await asyncio.sleep(0.2)

    async def sizer() -> None:
        while time.time() < stop_at:
            file, wal, runs = await asyncio.to_thread(_sizes, db)
            sizes.append({"t": round(time.time() - t0, 1), "db_mb": file / MB, "wal_mb": wal / MB,
                          "runs_rows": runs})
            await asyncio.sleep(args.size_every)
        file, wal, runs = await asyncio.to_thread(_sizes, db)
        sizes.append({"t": round(time.time() - t0, 1), "db_mb": file / MB, "wal_mb": wal / MB,
                      "runs_rows": runs})

    await asyncio.gather(emitter(), reader(), sizer())
    return {"emitted": emitted, "done": done, "commit_ms": commit_ms, "missed": missed,
            "sizes": sizes}


def _size_at(sizes: list[dict[str, float]], t: float) -> dict[str, float]:
    """The first size sample at or after ``t`` seconds."""
    return next((s for s in sizes if s["t"] >= t), sizes[-1])


async def one_trial(args: argparse.Namespace, label: str) -> dict[str, Any]:
    tmp = Path(mkdtemp("ifretb."))
    node = worker = None
    try:
        db = tmp / "state" / "ironflow.db"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        retention = ["--history-retention", "0"] if label == "A" else [
            "--history-retention", args.retention, "--janitor-interval", args.janitor_interval]
        if args.idempotency_window is not None:
            # Only a config file sets it; both trials get it (A deletes nothing anyway).
            config = tmp / "node.yaml"
            config.write_text(f"idempotency_window_s: {args.idempotency_window}\n")
            retention += ["-f", str(config)]
        node_log = tmp / "node.log"
        node = bench._spawn([sys.executable, "-m", "ironflow", "serve", "--dev", "--port", str(port),
                             "--db", str(db), "--state-dir", str(tmp / "state"),
                             "--log-level", "warning", *retention], node_log)
        await bench._wait_ready(url, node, node_log)
        out = tmp / "worker.jsonl"
        worker_log = tmp / "worker.log"
        worker = bench._spawn([sys.executable, str(HERE / "bench.py"), "--worker", "--server", url,
                               "--out", str(out), "--concurrency", str(args.concurrency)], worker_log)
        await bench._wait_worker_ready(out, worker, worker_log)
        tail = Tail(out)
        tail.read()  # the ready line
        async with bench._LoadClient(args.inflight + 4) as client:
            t0 = time.time()
            got = await _load(args, client, url, tail, db, t0)
            deleted = await _deleted_rows(client, url)
        hwm = bench._vm_hwm_kib(node.pid)
        window = (t0 + args.warmup, t0 + args.warmup + args.duration)
        in_window = sum(1 for r in got["done"].values() if window[0] <= r["end"] < window[1])
        start, end = _size_at(got["sizes"], args.warmup), got["sizes"][-1]
        total = lambda s: s["db_mb"] + s["wal_mb"]  # noqa: E731
        return {
            "trial": label,
            "retention": "off" if label == "A" else args.retention,
            "runs_per_s": in_window / args.duration,
            "steps_per_s": in_window * bench.STEPS_PER_RUN / args.duration,
            "step_commit_p50_ms": bench.pct(got["commit_ms"], 50),
            "step_commit_p99_ms": bench.pct(got["commit_ms"], 99),
            "commit_samples": len(got["commit_ms"]),
            "samples_deleted_before_read": got["missed"],
            "runs_done": len(got["done"]),
            "db_mb_after_warmup": total(start),
            "db_mb_end": total(end),
            "db_growth_mb": total(end) - total(start),
            "runs_rows_end": end["runs_rows"],
            "rows_deleted": deleted,
            "node_peak_rss_mb": hwm / 1024.0 if hwm else None,
            "sizes": got["sizes"],
        }
    finally:
        stop(worker)
        stop(node)
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
            TEMPS.remove(str(tmp))
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            if str(tmp) in TEMPS:
                TEMPS.remove(str(tmp))


COLUMNS = [
    ("runs/s", "runs_per_s", "{:.0f}"),
    ("steps/s", "steps_per_s", "{:.0f}"),
    ("step→commit p50 ms", "step_commit_p50_ms", "{:.2f}"),
    ("step→commit p99 ms", "step_commit_p99_ms", "{:.2f}"),
    ("samples", "commit_samples", "{:d}"),
    ("deleted first", "samples_deleted_before_read", "{:d}"),
    ("DB MB @warmup", "db_mb_after_warmup", "{:.1f}"),
    ("DB MB end", "db_mb_end", "{:.1f}"),
    ("growth MB", "db_growth_mb", "{:+.1f}"),
    ("runs rows end", "runs_rows_end", "{:d}"),
    ("node RSS MB", "node_peak_rss_mb", "{:.0f}"),
]


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    window = "24 h" if args.idempotency_window is None else f"{args.idempotency_window:g} s"
    print(f"\n{args.duration:.0f} s measured after {args.warmup:.0f} s warm-up per trial; "
          f"A: retention off, B: --history-retention {args.retention} --janitor-interval "
          f"{args.janitor_interval}; idempotency window {window}; "
          f"≤ {args.outstanding} runs outstanding, {args.inflight} emits in flight")
    heads = ["trial"] + [h for h, _, _ in COLUMNS]
    widths = [max(6, len(h)) for h in heads]
    print("  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    for row in report["trials"]:
        cells = [row["trial"]] + [fmt.format(row[k]) if row.get(k) is not None else "-" for _, k, fmt in COLUMNS]
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    for label, med in report["medians"].items():
        print(f"median {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    for k, v in report["ratios"].items():
        print(f"B/A {k}: {v:.3f}")
    for row in report["trials"]:
        if row["trial"] == "B":
            step = max(1, len(row["sizes"]) // 12)
            series = ", ".join(f"{s['t']:.0f}s {s['db_mb'] + s['wal_mb']:.1f}" for s in row["sizes"][::step])
            print(f"B size (MB, file+WAL) over time: {series}; rows deleted {row['rows_deleted']}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    trials = []
    for i, label in enumerate(args.order):
        if not args.json:
            print(f"trial {i + 1}/{len(args.order)} ({label}) ...", file=sys.stderr, flush=True)
        trials.append(await one_trial(args, label))
    keys = ["runs_per_s", "step_commit_p50_ms", "step_commit_p99_ms", "db_growth_mb"]
    medians = {
        label: {k: statistics.median(t[k] for t in trials if t["trial"] == label) for k in keys}
        for label in sorted(set(args.order))
    }
    ratios = {}
    if "A" in medians and "B" in medians:
        ratios = {k: medians["B"][k] / medians["A"][k] for k in keys[:3] if medians["A"][k]}
    return {"config": {k: v for k, v in vars(args).items()}, "cpus": os.cpu_count(),
            "trials": trials, "medians": medians, "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0, help="measured seconds per trial")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of load before measuring")
    ap.add_argument("--retention", default="5s", help="trial B's --history-retention")
    ap.add_argument("--janitor-interval", default="5s", help="trial B's --janitor-interval")
    ap.add_argument("--idempotency-window", type=float, default=None,
                    help="seconds; events are kept this long (default: the node's, 24 h)")
    ap.add_argument("--order", default="ABBA", help="trials to run, A = retention off, B = on")
    ap.add_argument("--concurrency", type=int, default=50, help="worker max_concurrent_jobs")
    ap.add_argument("--inflight", type=int, default=32, help="emit requests in flight")
    ap.add_argument("--outstanding", type=int, default=200,
                    help="runs emitted but not yet reported done, at most")
    ap.add_argument("--sample-every", type=int, default=20, help="read back 1 run in N for step→commit")
    ap.add_argument("--size-every", type=float, default=5.0, help="seconds between size samples")
    ap.add_argument("--keep", action="store_true", help="keep temp dirs (logs)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the whole report (size series included) to this JSON file")
    args = ap.parse_args()
    if set(args.order) - {"A", "B"}:
        ap.error("--order takes A and B only")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        report = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        sys.exit(130)
    finally:
        cleanup_all()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        _print(report, args)


if __name__ == "__main__":
    main()
