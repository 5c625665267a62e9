"""Wake-up lateness: ``wake_at`` → handler resumed on the worker, for many sleeps due at once.

Usage: python scripts/wake_bench.py [--sleeps 1000] [--backend sqlite|postgres|both]
                                    [--nodes 1] [--repeat 3] [--lead 6] [--slots N]
                                    [--waker-lookahead S]
       (or: python scripts/bench.py --wake 1000 [--backend, --nodes, --repeat,
        --wake-lead, --wake-slots])

Per repeat, fresh ``--dev`` node(s) (SQLite in a temp dir, or a fresh
database on a throwaway PostgreSQL cluster with its default durability that
this script starts; ``--nodes K`` puts K nodes on that one database) and one
streaming worker per node with ``--slots`` slots. ``--sleeps`` runs are
emitted (batch requests, spread over the nodes) of a function that calls
``step.sleep_until`` with one instant ``--lead`` seconds ahead (the same
millisecond for every run) and, the moment the handler is past the sleep,
notes ``time.time()`` in the worker process. The worker also notes when each
run's first segment started, to check that every sleep was parked before it
was due (otherwise raise ``--lead``).

Slots: by default each worker has as many slots as there are sleeps. A
handler that resumes needs a free slot, so with fewer slots the later sleeps
wait for earlier runs to finish and the figure measures the worker's
capacity, not the engine; with look-ahead (``waker_lookahead``) a resumed
job also holds its slot from its delivery until its wake time. Past 1,000
slots the nodes are started with ``--max-slots-per-session`` to match.
``--waker-lookahead`` is passed to the nodes (default: theirs, 1 s).

The notes are tuples in memory, written out every 0.1 s: taking one costs
the handler a ``time.time()`` and a list append, not a JSON encoding (1,000
handlers resume one after another in one process, so what each one does
before it yields delays the next).

The figures come from the worker's notes (a JSON-lines file), read after the
fact: the script polls nothing on the nodes while they work. Lateness =
resumed − wake_at, per run; printed: p50, p99, min, max (all resumed), and
how many handlers resumed per second from the first to the last (what bounds
the later ones' lateness), per repeat and the median over repeats. Nothing is
hard-coded.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from children import LIVE, REPO, child_env, cleanup_all, mkdtemp, spawn_node, stop

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def worker_main(url: str, out: str, slots: int) -> None:
    """A worker subprocess: serves ``napper`` and notes first starts and resumes."""
    import trio

    import ironflow

    notes: list[tuple[str, str, float]] = []

    @ironflow.function(id="napper", triggers=[ironflow.event("nap.go")])
    async def napper(ctx):  # type: ignore[no-untyped-def]
        # Before the sleep on every segment; the earliest note is the first segment's.
        notes.append((ctx.run.id, "parked", time.time()))
        await ctx.step.sleep_until("nap", ctx.event.data["at"])
        notes.append((ctx.run.id, "resumed", time.time()))
        return None

    worker = ironflow.StreamingWorker(url, [napper], max_concurrent_jobs=slots, reconnect_delay=0.5)

    async def main() -> None:
        with open(out, "a", buffering=1) as fh:
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                print("READY", flush=True)
                while True:
                    await trio.sleep(0.1)
                    if notes:
                        fh.write("".join(json.dumps({"run": r, k: t}) + "\n" for r, k, t in notes))
                        notes.clear()

    trio.run(main)


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))]


def _notes(outs: list[Path]) -> dict[str, dict[str, float]]:
    by_run: dict[str, dict[str, float]] = {}
    for out in outs:
        if out.exists():
            for line in out.read_text().splitlines():
                try:
                    note = json.loads(line)
                except ValueError:
                    continue  # a line still being written
                run = by_run.setdefault(note.pop("run"), {})
                for key, value in note.items():
                    run[key] = min(value, run.get(key, value))
    return by_run


# The nodes' own limit on one worker's slots (limits.max_slots_per_session).
NODE_SLOT_LIMIT = 1000


def _start_node(db: str, tmp: Path, k: int, slots: int, lookahead: float | None) -> str:
    extra = ["--max-slots-per-session", str(slots)] if slots > NODE_SLOT_LIMIT else []
    if lookahead is not None:
        extra += ["--waker-lookahead", str(lookahead)]
    return spawn_node(db, tmp / f"state{k}", tmp / f"node{k}.log", node_id=f"node-{k}", extra=extra)


def _start_worker(url: str, out: Path, slots: int) -> None:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", url, "--out", str(out), "--slots", str(slots)]
    proc = subprocess.Popen(argv, env=child_env(), cwd=REPO, stdout=subprocess.PIPE)
    LIVE.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"READY"


def one_repeat(
    db: str, nodes: int, sleeps: int, lead: float, slots: int, lookahead: float | None = None
) -> dict[str, float]:
    """Start the nodes and workers, park ``sleeps`` sleeps, measure, stop everything."""
    import httpx

    tmp = Path(mkdtemp("ifwake."))
    started = len(LIVE)
    try:
        urls = [_start_node(db, tmp, k, slots, lookahead) for k in range(nodes)]
        outs = [tmp / f"worker{k}.jsonl" for k in range(nodes)]
        for url, out in zip(urls, outs, strict=True):
            _start_worker(url, out, slots)
        at = round(time.time() + lead, 3)
        chunk = max(1, math.ceil(sleeps / (len(urls) * 2)))
        with httpx.Client(timeout=120) as http:
            for i, first in enumerate(range(0, sleeps, chunk)):
                events = [{"name": "nap.go", "data": {"at": at}} for _ in range(min(chunk, sleeps - first))]
                http.post(f"{urls[i % len(urls)]}/v1/events/batch", json={"events": events}).raise_for_status()
        deadline = at + 120
        while True:
            notes = _notes(outs)
            if sum("resumed" in n for n in notes.values()) >= sleeps or time.time() > deadline:
                break
            time.sleep(0.25)
        late = [(n["resumed"] - at) * 1000 for n in notes.values() if "resumed" in n]
        if len(late) < sleeps:
            raise SystemExit(f"only {len(late)} of {sleeps} sleeps resumed within 120 s of their wake time")
        last_parked = max(n["parked"] for n in notes.values())
        if last_parked > at - 0.1:
            raise SystemExit(f"the last sleep was parked {last_parked - at:+.2f} s from its wake time; raise --lead")
        # How fast the resumed segments went through once they started: what
        # bounds the lateness of the later ones.
        rate = (len(late) - 1) / max((max(late) - min(late)) / 1000, 1e-9)
        return {"p50_ms": pct(late, 50), "p99_ms": pct(late, 99), "min_ms": min(late), "max_ms": max(late),
                "resumed_per_s": rate, "parked_margin_s": at - last_parked}
    finally:
        for proc in LIVE[started:]:
            stop(proc)


def run(
    sleeps: int,
    backend: str,
    nodes: int,
    repeat: int,
    lead: float,
    slots: int | None = None,
    lookahead: float | None = None,
) -> None:
    """Measure and print, for each backend asked for (the entry ``bench.py --wake`` uses).

    ``slots``: each worker's; None gives every worker as many as there are
    sleeps. ``lookahead``: the nodes' ``--waker-lookahead`` (None: their default)."""
    from ironflow.testing import ThrowawayPostgres

    slots = sleeps if slots is None else slots

    atexit.register(cleanup_all)
    pg: ThrowawayPostgres | None = None
    try:
        for b in (["sqlite", "postgres"] if backend == "both" else [backend]):
            k = nodes if b == "postgres" else 1
            if b == "postgres" and pg is None:
                pg = ThrowawayPostgres(durable=True)
                pg.start()
            rows = []
            for i in range(repeat):
                db = pg.new_database("wake") if b == "postgres" and pg else f"{mkdtemp('ifwakedb.')}/ironflow.db"
                row = one_repeat(db, k, sleeps, lead, slots, lookahead)
                rows.append(row)
                print(f"  [{b}, {k} node{'s' * (k > 1)}] repeat {i + 1}: p50 {row['p50_ms']:.0f} ms,"
                      f" p99 {row['p99_ms']:.0f} ms, min {row['min_ms']:.0f} ms, max {row['max_ms']:.0f} ms;"
                      f" {row['resumed_per_s']:.0f} resumed/s",
                      file=sys.stderr, flush=True)
            med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            ahead = "" if lookahead is None else f", waker look-ahead {lookahead:g} s"
            print(f"{sleeps} sleeps due at the same instant, {b}, {k} node{'s' * (k > 1)}, one {slots}-slot"
                  f" worker per node{ahead}, median of {repeat}: lateness p50 {med['p50_ms']:.0f} ms,"
                  f" p99 {med['p99_ms']:.0f} ms, min {med['min_ms']:.0f} ms, max {med['max_ms']:.0f} ms;"
                  f" {med['resumed_per_s']:.0f} resumed/s (first → last)")
    finally:
        if pg is not None:
            pg.stop()
        cleanup_all()


def add_arguments(parser: argparse.ArgumentParser, *, sleeps_flag: str = "--sleeps") -> None:
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="sqlite")
    parser.add_argument("--nodes", type=int, default=1, help="PostgreSQL only: nodes on the one database")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lead", type=float, default=6.0, help="seconds from the emits to the common wake time")
    parser.add_argument("--slots", type=int, default=None,
                        help="each worker's max_concurrent_jobs (default: the number of sleeps)")
    parser.add_argument("--waker-lookahead", type=float, default=None,
                        help="the nodes' --waker-lookahead in seconds (default: theirs; 0 = off)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sleeps", type=int, default=1000)
    add_arguments(parser)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.out, args.slots)
        return
    run(args.sleeps, args.backend, args.nodes, args.repeat, args.lead, args.slots, args.waker_lookahead)


if __name__ == "__main__":
    main()
