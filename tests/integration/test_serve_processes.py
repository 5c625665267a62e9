"""``ironflow serve --processes 2`` as real processes on PostgreSQL.

One parent, two node processes on one port (SO_REUSEPORT): both answer, a
worker runs work through the shared port, SIGTERM to the parent drains both
(the graceful-drain seed, per process) and the parent exits 0. A node process
killed after serving is started again under its own node id.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.helpers import eventually
from tests.integration.procs import (
    Proc,
    db_rows,
    free_port,
    start_load_worker,
    start_node,
    stored_audit,
    wait_log,
)

pytestmark = pytest.mark.slow


async def answering_node_ids(url: str, want: set[str]) -> set[str]:
    """Node ids seen on ``/healthz``, one new connection per request, until ``want`` are seen."""
    seen: set[str] = set()

    async def check() -> bool:
        # A new connection (a new source port) each time: the kernel picks the process by its hash.
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            seen.add((await http.get("/healthz")).json()["node_id"])
        return want <= seen

    await eventually(check, timeout=5, interval=0.01, message=f"answers from {sorted(want)}")
    return seen


async def start_group(pg_url: str, tmp_path: Path, procs: list[Proc], port: int) -> Proc:
    """``ironflow serve --processes 2 --node-id grp`` on ``port``, once both processes serve."""
    parent = await start_node(
        pg_url, tmp_path / "state", tmp_path, node_id="grp", port=port, extra=["--processes", "2"]
    )
    procs.append(parent)
    await wait_log(parent, "2 node processes serving on port")
    return parent


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (trio starts them from a thread: read every task's list)."""
    return sorted(
        int(c) for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    )


async def test_two_processes_serve_one_port_run_work_and_drain_on_sigterm(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    parent = await start_group(pg_url, tmp_path, procs, port)
    assert await answering_node_ids(url, {"grp-1", "grp-2"}) == {"grp-1", "grp-2"}
    assert sorted(r[0] for r in db_rows(pg_url, "SELECT id FROM nodes")) == ["grp-1", "grp-2"]

    worker = await start_load_worker(url, tmp_path, name="worker", max_jobs=10)
    procs.append(worker)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        runs = [
            (await http.post("/v1/events", json={"name": "load.go", "data": {}})).json()["run_ids"][0]
            for _ in range(10)
        ]

        async def all_completed() -> bool:
            got = [(await http.get(f"/v1/runs/{r}")).json()["run"]["status"] for r in runs]
            return all(s == "completed" for s in got)

        await eventually(all_completed, timeout=10, message="10 runs completed")

    parent.signal(signal.SIGTERM)
    assert await parent.wait_exit(timeout=10) == 0, parent.tail()
    log = parent.log_path.read_text()
    assert "SIGTERM: draining 2 node processes" in log
    # Each process drained (its own audit records) and stopped on its own.
    drains = sorted(a.type for a in await stored_audit(pg_url) if a.type.startswith("node.drain."))
    assert drains == ["node.drain.completed"] * 2 + ["node.drain.started"] * 2
    assert "node: stopped node_id=grp-1" in log and "node: stopped node_id=grp-2" in log


async def test_a_process_killed_after_serving_is_started_again_under_its_node_id(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    port = free_port()
    parent = await start_group(pg_url, tmp_path, procs, port)
    first = children_of(parent.pid)
    assert len(first) == 2
    os.kill(first[0], signal.SIGKILL)
    await wait_log(parent, "died after serving (signal SIGKILL); starting it again in 1 s")
    await wait_log(parent, "serves again")
    assert len(set(children_of(parent.pid)) - set(first)) == 1
    await answering_node_ids(f"http://127.0.0.1:{port}", {"grp-1", "grp-2"})
    parent.signal(signal.SIGTERM)
    assert await parent.wait_exit(timeout=10) == 0, parent.tail()


async def test_dev_bootstrap_key_a_sibling_created_after_our_check_is_taken_not_an_error(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two --dev node processes on one state dir and database both find the key
    file's key missing from the database; the second to create it must start."""
    from ironflow.node import Node
    from tests.integration.conftest import node_config

    key = "ifkey_" + "ab" * 16
    node = Node(node_config(pg_url, tmp_path / "state"))
    node.config.bootstrap_key_path.parent.mkdir(parents=True)
    node.config.bootstrap_key_path.write_text(json.dumps({"key": key}))
    monkeypatch.delenv("IRONFLOW_BOOTSTRAP_ADMIN_KEY", raising=False)
    await node.store.open()
    try:
        checks = 0
        authenticate = node.store.authenticate

        async def sibling_creates_it_after_our_check(k: str) -> Any:
            nonlocal checks
            checks += 1
            found = await authenticate(k)
            if checks == 1:
                await node.store.create_api_key("org", "admin", key=key)  # the sibling
            return found

        monkeypatch.setattr(node.store, "authenticate", sibling_creates_it_after_our_check)
        await node._bootstrap_key()
        assert node.bootstrap_key == key and checks == 2
        assert (await authenticate(key)) is not None
    finally:
        await node.store.close()


async def test_a_process_that_cannot_start_stops_the_group_with_its_exit_code(
    tmp_path: Path, procs: list[Proc]
) -> None:
    unreachable = f"postgresql://nobody@127.0.0.1:{free_port()}/none"
    parent = Proc(
        [sys.executable, "-m", "ironflow", "serve", "--db", unreachable, "--port", "0",
         "--processes", "2", "--node-id", "grp", "--state-dir", str(tmp_path / "state")],
        tmp_path / "grp.log",
    )
    procs.append(parent)
    assert await parent.wait_exit(timeout=30) == 1, parent.tail()
    assert "before it served; stopping the group" in parent.log_path.read_text(), parent.tail()


async def test_node_processes_whose_parent_is_killed_drain_and_exit(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    port = free_port()
    parent = await start_group(pg_url, tmp_path, procs, port)
    children = children_of(parent.pid)
    parent.signal(signal.SIGKILL)
    await parent.wait_exit(timeout=5)

    async def orphans_gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() for pid in children)

    await eventually(orphans_gone, timeout=10, message="the orphaned node processes exited")
    log = parent.log_path.read_text()
    assert log.count("node: parent process gone, draining") == 2, log[-2000:]
    assert "node: stopped node_id=grp-1" in log and "node: stopped node_id=grp-2" in log
