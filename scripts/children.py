"""Child processes and temp dirs of the measurement scripts, cleaned up on any exit.

``bench.py`` and ``recovery_bench.py`` start nodes, workers and PostgreSQL
clusters; everything they start is tracked here so that a failure, Ctrl-C or
SIGTERM leaves no process and no directory behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]

# Processes still running and temp dirs still on disk; cleanup_all() ends them.
LIVE: list[subprocess.Popen[bytes]] = []
TEMPS: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment with the repo importable and no inherited IRONFLOW_* settings."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in [k for k in env if k.startswith("IRONFLOW_")]:
        del env[k]  # a node gets its settings from the script's flags only
    env.update(extra or {})
    return env


def mkdtemp(prefix: str) -> str:
    """A tracked temp dir under /tmp (short: PostgreSQL socket paths are ≤ 107 bytes)."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    TEMPS.append(d)
    return d


def stop(p: subprocess.Popen[bytes] | None, *, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """``sig`` (a node or worker drains), a second SIGTERM (stop now), then SIGKILL."""
    if p is None:
        return
    try:
        for s, wait in ((sig, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if p.poll() is not None:
                break
            try:
                p.send_signal(s)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                continue
    finally:
        if p in LIVE:
            LIVE.remove(p)


def cleanup_all() -> None:
    for p in list(LIVE):
        stop(p, grace=3.0)
    for d in list(TEMPS):
        shutil.rmtree(d, ignore_errors=True)
        TEMPS.remove(d)


def spawn_dev_node(db: str, state: str, port: int, extra: list[str] | None = None,
                   log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """A tracked ``--dev`` node subprocess on ``port`` (``extra`` serve flags, its
    output to ``log`` or ours); not waited for: see :func:`wait_ready`."""
    argv = [sys.executable, "-m", "ironflow", "serve", "--dev", "--port", str(port),
            "--state-dir", state, "--log-level", "WARNING", "--db", db, *(extra or [])]
    node = subprocess.Popen(argv, env=child_env(), stderr=log)
    LIVE.append(node)
    return node


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30.0) -> None:
    """Return once ``url``/readyz answers 200; SystemExit if it does not in time
    (or ``proc`` exits first)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"node for {url} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"node on {url} did not become ready")


def start_dev_node(db: str | None, prefix: str, extra: list[str] | None = None) -> str:
    """A ``--dev`` node subprocess (SQLite in a tracked temp dir unless ``db``, ``extra``
    serve flags); its URL once ready."""
    port = free_port()
    state = mkdtemp(prefix)
    node = spawn_dev_node(db or f"{state}/ironflow.db", state, port, extra)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, node)
    return url


def start_script_worker(script: str, url: str, args: list[str] | None = None,
                        log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """``script --worker URL [args]`` as a tracked subprocess (its stderr to ``log``
    or ours); returns it once it printed READY."""
    worker = subprocess.Popen([sys.executable, script, "--worker", url, *(args or [])],
                              env=child_env(), stdout=subprocess.PIPE, stderr=log)
    LIVE.append(worker)
    assert worker.stdout is not None and worker.stdout.readline().strip() == b"READY"
    return worker


def serve_worker_until_stopped(worker: object) -> None:
    """Run an SDK ``worker`` in this process; print READY once it registered
    (what :func:`start_script_worker` waits for)."""
    import trio

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)  # type: ignore[attr-defined]
            print("READY", flush=True)

    trio.run(run)


def spawn_node(db: str, state_dir: Path, log: Path, *, node_id: str, extra: list[str] | None = None) -> str:
    """A ``--dev`` node on ``db`` whose output goes to ``log`` (tracked); its URL once ready."""
    import sys
    import time

    import httpx

    port = free_port()
    argv = [sys.executable, "-m", "ironflow", "serve", "--dev", "--port", str(port), "--node-id", node_id,
            "--state-dir", str(state_dir), "--log-level", "WARNING", "--db", db, *(extra or [])]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, env=child_env(), cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    LIVE.append(proc)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"node {node_id} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"node {node_id} did not become ready; see {log}")
