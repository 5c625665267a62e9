"""A real engine node in-process (port 0), on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ironflow.config import NodeConfig, load_config
from ironflow.node import Node
from tests.clock import open_test_store
from tests.integration.fuzz_target import Target
from tests.integration.procs import Proc, free_port, start_node, start_worker
from tests.procs.worker_loop import LOOP_ENV, LOOPS

# Timings for in-process tests: --dev values, plus a long idle re-check so a
# test proves the dispatcher is kicked rather than polling.
TEST_TIMINGS: dict[str, Any] = {"dispatch_idle_poll_s": 30.0, "restart_backoff_s": 0.01}


def node_config(db: str, state_dir: Path, **timings: Any) -> NodeConfig:
    return load_config(
        env={},
        dev=True,
        overrides={"db": db, "port": 0, "state_dir": str(state_dir), "log_level": "DEBUG"},
        timing_overrides={**TEST_TIMINGS, **timings},
    )


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of each backend."""
    if request.param == "sqlite":
        return str(tmp_path / "ironflow.db")
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(params=LOOPS)
def worker_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test once with its worker processes on asyncio, once on trio.

    Every process test starts asyncio workers (the default of
    ``tests/procs/worker_loop.py``); a representative subset (kill -9, SIGTERM
    drain, the drain deadline, a lost worker's counters) asks for this fixture
    to prove the Trio worker the same, without doubling the slow suite.
    """
    monkeypatch.setenv(LOOP_ENV, request.param)
    return str(request.param)


@pytest.fixture
def node_timings() -> dict[str, Any]:
    """Override in a test module to change the node's timings."""
    return {}


@pytest.fixture
async def node(
    database_url: str, tmp_path: Path, nursery: trio.Nursery, node_timings: dict[str, Any]
) -> AsyncIterator[Node]:
    config = node_config(database_url, tmp_path / ".ironflow", **node_timings)
    # A store whose clock a test can advance (tests/clock.py).
    started: Node = await nursery.start(Node(config, store=open_test_store(database_url)).run)
    yield started
    started.stop()


@pytest.fixture
async def http(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=node.url, timeout=10.0) as client:
        yield client


# ── real processes ──────────────────────────────────────────────────────────


@pytest.fixture
async def procs() -> AsyncIterator[list[Proc]]:
    """Processes a test started; each is killed (if still alive) afterwards."""
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop()


class ServedNode:
    """An ``ironflow serve --dev`` process on a database of the test's backend."""

    def __init__(self, proc: Proc, db: str, port: int) -> None:
        self.proc, self.db, self.port = proc, db, port
        self.url = f"http://127.0.0.1:{port}"


async def serve_node(
    procs: list[Proc], db: str, tmp_path: Path, node_id: str, *extra: str, env: dict[str, str] | None = None,
    program: list[str] | None = None,
) -> ServedNode:
    """Start one more node process (``extra``: serve flags; ``program``: what
    stands for ``ironflow serve``) and wait until ready."""
    port = free_port()
    proc = await start_node(
        db, tmp_path / node_id, tmp_path, node_id=node_id, port=port, extra=list(extra), env=env,
        program=program,
    )
    procs.append(proc)
    return ServedNode(proc, db, port)


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """A node process (SQLite) and an honest worker process, one per test module."""
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def start() -> tuple[Any, Any]:
        # A poll in a fuzzed body may ask to wait: hold none open for long.
        node = await start_node(
            str(tmp / "db.sqlite"), tmp / "state", tmp, node_id="fuzz", port=port,
            extra=["--poll-max-wait", "0.2"],
        )
        worker = await start_worker(url, tmp / "effects", tmp, slow=0.0)
        return node, worker

    node, worker = trio.run(start)
    t = Target(node, worker, url, tmp / "effects", tmp / "db.sqlite")
    try:
        yield t
    finally:
        t.http.close()
        worker.stop()
        node.stop()
