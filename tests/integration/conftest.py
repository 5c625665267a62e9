"""A real engine node in-process (port 0), on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ironflow.config import NodeConfig, load_config
from ironflow.node import Node

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


@pytest.fixture
def node_timings() -> dict[str, Any]:
    """Override in a test module to change the node's timings."""
    return {}


@pytest.fixture
async def node(
    database_url: str, tmp_path: Path, nursery: trio.Nursery, node_timings: dict[str, Any]
) -> AsyncIterator[Node]:
    started: Node = await nursery.start(Node(node_config(database_url, tmp_path / ".ironflow", **node_timings)).run)
    yield started
    started.stop()


@pytest.fixture
async def http(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=node.url, timeout=10.0) as client:
        yield client
