"""Real worker and node processes for crash tests (kill -9, SIGSTOP)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import trio

ROOT = Path(__file__).resolve().parents[2]
CRASH_WORKER = ROOT / "tests" / "procs" / "crash_worker.py"
LOAD_WORKER = ROOT / "tests" / "procs" / "load_worker.py"
DRAIN_WORKER = ROOT / "tests" / "procs" / "drain_worker.py"
WAKE_WORKER = ROOT / "tests" / "procs" / "wake_worker.py"
RACE_WORKER = ROOT / "tests" / "procs" / "race_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose stdout announces readiness with a ``READY`` line."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.pid = self.popen.pid

    async def wait_line(self, prefix: str, timeout: float = 20.0) -> str:
        assert self.popen.stdout is not None
        stdout = self.popen.stdout
        with trio.fail_after(timeout):
            while True:
                line = (await trio.to_thread.run_sync(stdout.readline, abandon_on_cancel=True)).decode()
                if not line:
                    raise AssertionError(f"process {self.pid} exited before {prefix!r}; log: {self.tail()}")
                if line.startswith(prefix):
                    return line.strip()

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the wall-clock time just before it was sent."""
        at = time.time()
        os.kill(self.pid, sig)
        return at

    def alive(self) -> bool:
        return self.popen.poll() is None

    async def wait_exit(self, timeout: float = 30.0) -> int:
        with trio.fail_after(timeout):
            while self.popen.poll() is None:
                await trio.sleep(0.02)
        return self.popen.returncode

    def stop(self) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.popen.kill()
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdout:
            self.popen.stdout.close()
        self._log.close()

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


async def start_worker(server: str, effects: Path, log_dir: Path, *, pull: bool = False, slow: float = 30.0, name: str = "worker") -> Proc:
    argv = [sys.executable, str(CRASH_WORKER), server, str(effects), "--slow", str(slow)]
    if pull:
        argv.append("--pull")
    proc = Proc(argv, log_dir / f"{name}.log")
    await proc.wait_line("READY")
    return proc


async def start_load_worker(server: str, log_dir: Path, *, name: str, max_jobs: int = 50) -> Proc:
    """A worker serving ``load3`` (three trivial steps, event ``load.go``)."""
    proc = Proc([sys.executable, str(LOAD_WORKER), server, "--max-jobs", str(max_jobs)],
                log_dir / f"{name}.log")
    await proc.wait_line("READY")
    return proc


async def start_wake_worker(procs: list[Proc], url: str, log_dir: Path, name: str, *args: str) -> Proc:
    """``tests/procs/wake_worker.py`` on ``url`` (``args`` its flags), tracked in
    ``procs``, its log in ``log_dir``; returned once it registered."""
    proc = Proc([sys.executable, str(WAKE_WORKER), url, *args], log_dir / f"{name}.log")
    procs.append(proc)
    await proc.wait_line("READY")
    return proc


async def start_race_worker(
    procs: list[Proc], url: str, effects: Path, log_dir: Path, name: str, *args: str
) -> Proc:
    """``tests/procs/race_worker.py`` on ``url`` (``args`` its flags), marking
    into ``effects``, tracked in ``procs``; returned once it registered."""
    proc = Proc([sys.executable, str(RACE_WORKER), url, str(effects), *args], log_dir / f"{name}.log")
    procs.append(proc)
    await proc.wait_line("READY")
    return proc


async def start_node(
    db: str, state_dir: Path, log_dir: Path, *, node_id: str, port: int, extra: list[str] | None = None,
    env: dict[str, str] | None = None, program: list[str] | None = None,
) -> Proc:
    """A node process (``program``: what stands for ``ironflow serve``), once /readyz is 200."""
    argv = [
        *(program or [sys.executable, "-m", "ironflow", "serve"]), "--dev", "--db", db, "--port", str(port),
        "--node-id", node_id, "--state-dir", str(state_dir), *(extra or []),
    ]
    proc = Proc(argv, log_dir / f"{node_id}.log", env=env)
    import httpx

    url = f"http://127.0.0.1:{port}"
    with trio.fail_after(30):
        while True:
            if not proc.alive():
                raise AssertionError(f"node {node_id} exited: {proc.tail()}")
            try:
                async with httpx.AsyncClient() as client:
                    if (await client.get(url + "/readyz")).status_code == 200:
                        return proc
            except httpx.TransportError:
                pass
            await trio.sleep(0.1)


def node_ports(backend: str) -> list[int]:
    """Free ports for a test's nodes: one on SQLite, two sharing PostgreSQL."""
    return [free_port()] if backend == "sqlite" else [free_port(), free_port()]


async def start_nodes(db: str, tmp_path: Path, ports: list[int], procs: list[Proc]) -> list[Proc]:
    """Node ``n<i>`` on each of ``ports``, started side by side; each is added
    to ``procs`` once ready (for the test's clean-up, even if another fails).
    Returns them in the order of ``ports``."""
    started: dict[int, Proc] = {}

    async def one(i: int, port: int) -> None:
        started[i] = await start_node(db, tmp_path / f"n{i}", tmp_path, node_id=f"n{i}", port=port)
        procs.append(started[i])

    async with trio.open_nursery() as nursery:
        for i, port in enumerate(ports):
            nursery.start_soon(one, i, port)
    return [started[i] for i in range(len(ports))]


async def start_drain_worker(
    procs: list[Proc], server: str, effects: Path, log_dir: Path, name: str, *args: str
) -> Proc:
    """``tests/procs/drain_worker.py`` (its flags in ``args``), once registered."""
    argv = [sys.executable, str(DRAIN_WORKER), server, str(effects), *args]
    proc = Proc(argv, log_dir / f"{name}.log")
    procs.append(proc)
    await proc.wait_line("READY")
    return proc


def assert_worker_loop(proc: Proc, loop: str) -> None:
    """The worker process ran on ``loop`` (``tests/procs/worker_loop.py`` names it)."""
    assert f"worker loop: {loop}" in proc.log_path.read_text(errors="replace"), proc.tail()


async def wait_log(proc: Proc, text: str, timeout: float = 10.0) -> None:
    """Wait until the process's stderr holds ``text``."""
    with trio.fail_after(timeout):
        while text not in proc.log_path.read_text(errors="replace"):
            assert proc.alive(), f"process exited before logging {text!r}: {proc.tail()}"
            await trio.sleep(0.02)


def read_effects(path: Path) -> list[tuple[float, str, str, int]]:
    """Every recorded side effect: (time, run_id, what, pid)."""
    if not path.exists():
        return []
    rows: list[tuple[float, str, str, int]] = []
    for line in path.read_text().splitlines():
        t, run_id, what, pid = line.split()
        rows.append((float(t), run_id, what, int(pid)))
    return rows


async def wait_effect(path: Path, run_id: str, what: str, *, pid: int | None = None, timeout: float = 30.0) -> tuple[float, str, str, int]:
    with trio.fail_after(timeout):
        while True:
            for row in read_effects(path):
                if row[1] == run_id and row[2] == what and (pid is None or row[3] == pid):
                    return row
            await trio.sleep(0.005)


def count(rows: list[Any], run_id: str, what: str) -> int:
    return sum(1 for r in rows if r[1] == run_id and r[2] == what)


async def stored_runs(db: str, run_ids: list[str]) -> dict[str, Any]:
    """Each run's row, read straight from the database (the node may be gone)."""
    from ironflow.store import open_store

    store = open_store(db)
    await store.open()
    try:
        return {run_id: (await store.get_run(run_id)).run for run_id in run_ids}
    finally:
        await store.close()


async def stored_audit(db: str, run_id: str | None = None) -> list[Any]:
    """Audit records from the database: a run's, or all of them."""
    from ironflow.store import open_store

    store = open_store(db)
    await store.open()
    try:
        return list(await store.list_audit(run_id=run_id, limit=10_000))
    finally:
        await store.close()


def db_rows(db: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of one read-only query, straight from the database (``?`` placeholders).

    For counting what a test must see *in the database* (step rows, audit
    records), independently of the node's API.
    """
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db) as conn:
            return list(conn.execute(sql.replace("?", "%s"), params).fetchall())
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        return list(conn.execute(sql, params).fetchall())
    finally:
        conn.close()
