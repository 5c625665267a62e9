"""Shared fixtures: a throwaway PostgreSQL cluster, a fresh database per test,
and the ``store`` fixture that runs a test once per backend.

Set ``IRONFLOW_TEST_PG_URL`` (``postgresql://user@host:port``) to use an
existing server instead of starting one. Without PostgreSQL binaries the
PostgreSQL tests FAIL: CI must never silently skip a backend.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

from ironflow.store import Store
from ironflow.testing import ThrowawayPostgres
from tests.clock import open_test_store

BACKENDS = ["sqlite", "postgres"]


# ── PostgreSQL ──────────────────────────────────────────────────────────────


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """URL of a PostgreSQL server for this test session (no database part)."""
    existing = os.environ.get("IRONFLOW_TEST_PG_URL")
    if existing:
        yield existing.rstrip("/")
        return
    pg = ThrowawayPostgres()
    error = ""
    try:
        url = pg.start()
    except RuntimeError as e:  # e.g. no server binaries: FAIL, never skip
        error = f"{e} Or set IRONFLOW_TEST_PG_URL to an existing server."
    if error:
        pytest.fail(error, pytrace=False)
    try:
        yield url
    finally:
        pg.stop()


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """URL of a fresh, empty database on the test server, dropped afterwards."""
    import psycopg

    url = ThrowawayPostgres(pg_server).new_database()
    yield url
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(f"{pg_server}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ── stores ──────────────────────────────────────────────────────────────────


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for each backend in turn (SQLite in ``tmp_path``)."""
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path / 'state' / 'ironflow.db'}"


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """An opened store on each backend; closed after the test."""
    s = open_test_store(store_url)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


# ── a watchdog for hung tests ───────────────────────────────────────────────

# Longest any single test may take, set-up and teardown included (the slowest
# crash test needs about a minute). Past it every Trio task's await stack is
# printed and the run is ended: a hung test must fail CI, never stall it.
TEST_DEADLINE_S = float(os.environ.get("IRONFLOW_TEST_DEADLINE_S", "300"))

_trio_token: list[trio.lowlevel.TrioToken] = []


def _task_tree(task: trio.lowlevel.Task, depth: int = 0) -> list[str]:
    frames = [
        f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{lineno} {f.f_code.co_name}"
        for f, lineno in task.iter_await_frames()
    ]
    lines = [f"{'  ' * depth}{task.name}: {' > '.join(frames[-8:])}"]
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            lines += _task_tree(child, depth + 1)
    return lines


def _remember_token(fn: Any) -> Any:
    @functools.wraps(fn)
    async def test(*args: Any, **kwargs: Any) -> Any:
        try:
            _trio_token[:] = [trio.lowlevel.current_trio_token()]
        except RuntimeError:
            pass  # an AnyIO test on asyncio: no Trio task tree to print
        return await fn(*args, **kwargs)

    return test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every async test runs on Trio (pytest-trio) unless it is an AnyIO test.

    This is pytest-trio's ``trio_mode``, less the tests marked ``anyio``
    (tests/sdk: the SDK on both loops), which AnyIO's plugin runs.
    """
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        fn = item.obj
        inner = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)
        if not inspect.iscoroutinefunction(inner):
            continue
        if item.get_closest_marker("anyio") is None:
            item.add_marker(pytest.mark.trio)
        if inspect.iscoroutinefunction(fn):
            item.obj = _remember_token(fn)


def _on_deadline(nodeid: str) -> None:
    sys.stderr.write(f"\n!!! {nodeid} still running after {TEST_DEADLINE_S:g}s\n")
    if _trio_token:
        try:
            _trio_token[0].run_sync_soon(
                lambda: sys.stderr.write(
                    "\n".join(_task_tree(trio.lowlevel.current_root_task())) + "\n"
                )
            )
        except trio.RunFinishedError:
            pass
    time.sleep(2.0)
    sys.stderr.flush()
    os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _trio_token.clear()
    timer = threading.Timer(TEST_DEADLINE_S, _on_deadline, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
