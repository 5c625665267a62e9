#!/usr/bin/env python
"""The SDK's figures for docs/sdk.md: the asyncio worker against the Trio worker.

    python scripts/sdk_bench.py [--rounds 3] [--runs 2000] [--loops asyncio,trio] [--json]

Three measurements, all in one sitting so their ratios hold:

* throughput: ``scripts/bench.py`` (its loaded phase: ``--runs`` runs of three
  steps, 100 emits in flight, one worker with 50 slots, a fresh ``--dev``
  node per trial: the workload of ../shared/peers/restate/) once per loop per
  round, the loops' order alternating between rounds. Per trial: steps/s and
  the worker's CPU per 3-step run. Medians over the rounds.
* idle RSS: a worker process per loop (one function, registered, then 2 s
  idle) against one node; ``VmRSS``, median of ``--rounds`` alternating starts.
* install size: this checkout's wheel installed into two fresh venvs, plain
  and with ``[server]``; the MB their ``site-packages`` hold.

Nothing is hard-coded: every figure printed is measured by this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from children import free_port, spawn_dev_node, wait_ready  # noqa: E402

# Idle means registered and waiting: long enough for start-up garbage to settle.
IDLE_SETTLE_S = 2.0

IDLE_WORKER = """
import asyncio, sys, time
import ironflow

@ironflow.function(id="idle", triggers=[ironflow.event("idle.go")])
async def idle(ctx):
    return 1

async def main():
    worker = ironflow.StreamingWorker(sys.argv[1], [idle])
    async with worker.running():
        print("READY", flush=True)
        await __import__("anyio").sleep_forever()

if sys.argv[2] == "trio":
    import trio
    trio.run(main)
else:
    asyncio.run(main())
"""


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def throughput(loop: str, runs: int) -> dict[str, float]:
    """One bench.py trial with the worker on ``loop``: steps/s, worker CPU ms per run."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--json", "--repeat", "1",
         "--runs", str(runs), "--inflight", "100", "--concurrency", "50",
         "--idle-events", "10", "--latency", "10", "--worker-loop", loop],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    (row,) = report["backends"]["sqlite"]["repeats"]
    return {
        "steps_per_s": row["steps_per_s"],
        "worker_cpu_ms_per_run": row["cpu_worker_s"] / runs * 1000.0,
        "worker_peak_rss_mb": row["worker_peak_rss_mb"],
    }


def idle_rss(loops: list[str], rounds: int, tmp: Path) -> dict[str, float]:
    """Median idle RSS (MB) of a one-function worker per loop, against one node."""
    port = free_port()
    node = spawn_dev_node(str(tmp / "idle.db"), str(tmp / "idle-state"), port)
    url = f"http://127.0.0.1:{port}"
    script = tmp / "idle_worker.py"
    script.write_text(IDLE_WORKER)
    samples: dict[str, list[float]] = {loop: [] for loop in loops}
    try:
        wait_ready(url, node)
        for i in range(rounds):
            for loop in loops if i % 2 == 0 else loops[::-1]:
                proc = subprocess.Popen([sys.executable, str(script), url, loop],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                try:
                    assert proc.stdout is not None and proc.stdout.readline().strip() == b"READY"
                    time.sleep(IDLE_SETTLE_S)
                    samples[loop].append(_rss_kib(proc.pid) / 1024.0)
                finally:
                    proc.kill()
                    proc.wait()
    finally:
        node.kill()
        node.wait()
    return {loop: statistics.median(v) for loop, v in samples.items()}


def _dir_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total / 1e6


def install_sizes(tmp: Path) -> dict[str, float]:
    """MB in site-packages of a fresh venv: the plain install and ``[server]``."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp / "wheels"), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = (tmp / "wheels").glob("ironflow_py-*.whl")
    sizes = {}
    for name, spec in (("light", str(wheel)), ("server", f"{wheel}[server]")):
        venv = tmp / f"venv-{name}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", spec],
                       check=True, capture_output=True)
        (site,) = venv.glob("lib/python*/site-packages")
        sizes[name] = _dir_mb(site)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--loops", default="asyncio,trio")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loops = args.loops.split(",")
    trials: dict[str, list[dict[str, float]]] = {loop: [] for loop in loops}
    with tempfile.TemporaryDirectory(prefix="ironflow-sdk-bench-") as tmp_s:
        tmp = Path(tmp_s)
        for i in range(args.rounds):
            for loop in loops if i % 2 == 0 else loops[::-1]:
                print(f"round {i + 1}/{args.rounds}: {loop} ...", file=sys.stderr, flush=True)
                trials[loop].append(throughput(loop, args.runs))
        rss = idle_rss(loops, args.rounds, tmp)
        sizes = install_sizes(tmp)
    report: dict[str, Any] = {"runs": args.runs, "rounds": args.rounds, "loops": {}}
    for loop in loops:
        report["loops"][loop] = {
            key: {"median": statistics.median(t[key] for t in trials[loop]),
                  "min": min(t[key] for t in trials[loop]),
                  "max": max(t[key] for t in trials[loop])}
            for key in ("steps_per_s", "worker_cpu_ms_per_run", "worker_peak_rss_mb")
        }
        report["loops"][loop]["idle_rss_mb"] = rss[loop]
    report["install_mb"] = sizes
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.runs} runs x 3 steps, {args.rounds} alternating rounds (median [min-max])")
    for loop, figures in report["loops"].items():
        tp, cpu = figures["steps_per_s"], figures["worker_cpu_ms_per_run"]
        print(f"  {loop:8s} {tp['median']:7.0f} [{tp['min']:.0f}-{tp['max']:.0f}] steps/s   "
              f"worker CPU {cpu['median']:.3f} [{cpu['min']:.3f}-{cpu['max']:.3f}] ms/run   "
              f"idle RSS {figures['idle_rss_mb']:.1f} MB")
    print(f"  install: light {sizes['light']:.1f} MB, with [server] {sizes['server']:.1f} MB")


if __name__ == "__main__":
    main()
