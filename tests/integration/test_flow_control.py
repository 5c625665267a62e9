"""Ingest-side flow control with real node and worker processes
(tests/procs/flow_worker.py): rate limit, debounce (with and without
max_wait), singleton skip and cancel, event batches — driven through the
HTTP API at full rate, across two nodes on PostgreSQL (each limit holds in
total, not per node) and one on SQLite, with a node killed (-9) while a
batch is filling. Every scenario runs at once in one pair of node starts.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.integration.helpers import wait_for_run
from tests.integration.procs import ROOT, Proc, db_rows, free_port, start_node

pytestmark = [pytest.mark.slow, pytest.mark.serial]

FLOW_WORKER = ROOT / "tests" / "procs" / "flow_worker.py"


async def _emit(http: httpx.AsyncClient, name: str, data: Any) -> dict[str, Any]:
    resp = await http.post("/v1/events", json={"name": name, "data": data})
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


async def _emit_all(clients: list[httpx.AsyncClient], name: str, datas: list[Any]) -> list[dict[str, Any]]:
    """Every event at once, spread over the nodes round robin; answers in order."""
    answers: list[dict[str, Any]] = [{} for _ in datas]

    async def one(i: int) -> None:
        answers[i] = await _emit(clients[i % len(clients)], name, datas[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(datas)):
            nursery.start_soon(one, i)
    return answers


def _runs(db: str, function_id: str) -> list[dict[str, Any]]:
    rows = db_rows(
        db, "SELECT id, status, output, started_at, event_id, created_at FROM runs"
        " WHERE function_id = ? ORDER BY created_at", (function_id,),
    )
    return [
        {"id": r[0], "status": r[1], "output": json.loads(r[2]) if r[2] else None,
         "started_at": r[3], "event_id": r[4]}
        for r in rows
    ]


async def _until(check: Any, what: str, timeout: float = 30.0) -> Any:
    with trio.move_on_after(timeout):
        while True:
            value = check()
            if value:
                return value
            await trio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def _rate_limit(clients: list[httpx.AsyncClient], db: str) -> None:
    answers = await _emit_all(clients, "flow.signup", [{"user": "ann"}] * 20)
    started = [a for a in answers if a["run_ids"]]
    skipped = [a for a in answers if a["skipped"]]
    assert len(started) == 1 and len(skipped) == 19
    assert {a["skipped"][0]["mechanism"] for a in skipped} == {"rate_limit"}
    record = (await clients[-1].get(f"/v1/events/{skipped[0]['event_id']}")).json()
    assert record["run_ids"] == [] and record["flow"][0]["outcome"] == "skipped"
    await wait_for_run(clients[0], started[0]["run_ids"][0], timeout=30)
    assert len(_runs(db, "welcome")) == 1


async def _received(client: httpx.AsyncClient, answers: list[dict[str, Any]]) -> list[float]:
    return [(await client.get(f"/v1/events/{a['event_id']}")).json()["received_at"] for a in answers]


def _quiet_periods(received: list[float], period: float) -> int:
    """How many quiet periods events received at these times (database clock)
    make: a loaded machine may delay an emit past the period."""
    return 1 + sum(1 for a, b in zip(received, received[1:], strict=False) if b - a >= period)


async def _debounce(clients: list[httpx.AsyncClient], db: str) -> None:
    answers = []
    for n in range(10):
        answers.append(await _emit(clients[n % len(clients)], "flow.edit", {"user": "bob", "n": n}))
        await trio.sleep(0.1)
    received = await _received(clients[0], answers)
    runs = list(dict.fromkeys(a["debounced"][0]["run_id"] for a in answers))
    assert len(runs) == _quiet_periods(received, 2.0)  # one, unless the machine stalled an emit 2 s
    run_id = runs[-1]
    pending = (await clients[0].get("/v1/debounces")).json()["debounces"]
    if pending:  # not yet fired (it fires 2 s after the last event)
        assert [d["run_id"] for d in pending if d["function_id"] == "digest"] == [run_id]
        detail = (await clients[-1].get(f"/v1/runs/{run_id}")).json()
        assert detail["waiting_reason"].startswith("debounced until")
    done = await wait_for_run(clients[0], run_id, timeout=30)
    assert done["run"]["output"] == {"n": 9}
    assert done["run"]["started_at"] - received[-1] >= 1.9  # 2 s after the last event
    assert len(_runs(db, "digest")) == len(runs)


async def _debounce_max_wait(clients: list[httpx.AsyncClient], db: str) -> None:
    t0 = trio.current_time()
    answers = []
    while trio.current_time() - t0 < 6.0:  # a steady stream: the 2 s period never elapses
        answers.append(await _emit(clients[len(answers) % len(clients)], "flow.tick", {"n": len(answers)}))
        await trio.sleep(0.1)
    n = len(answers)
    runs = await _until(
        lambda: (r := _runs(db, "stream")) and all(x["status"] == "completed" for x in r)
        and r[-1]["output"] == {"n": n - 1} and r, "the stream's last debounced run",
    )
    # max_wait=3: a run about every 3 s of the 6 s stream (more only if the
    # machine stalled an emit past the period), the last with its last event.
    stalls = _quiet_periods(await _received(clients[0], answers), 2.0) - 1
    assert 2 <= len(runs) <= 3 + stalls, runs
    ns = [r["output"]["n"] for r in runs]
    assert ns == sorted(ns) and len(set(ns)) == len(ns)


async def _singleton(clients: list[httpx.AsyncClient], db: str) -> None:
    [first] = (await _emit(clients[0], "flow.sync", {"account": 1}))["run_ids"]
    await wait_for_run(clients[0], first, {"waiting", "running"}, timeout=30)
    answers = await _emit_all(clients, "flow.sync", [{"account": 1}] * 10)
    assert all(a["run_ids"] == [] and a["skipped"][0]["run_id"] == first for a in answers)
    await wait_for_run(clients[0], first, timeout=30)  # its 4 s sleep over: the key is free
    assert len((await _emit(clients[-1], "flow.sync", {"account": 1}))["run_ids"]) == 1
    # Cancel mode: the newer run replaces the sleeping one, whichever node takes it.
    [old] = (await _emit(clients[0], "flow.replace", {}))["run_ids"]
    await _until(
        lambda: any(r["status"] == "waiting" and r["id"] == old for r in _runs(db, "replace")),
        "the replaced run asleep",
    )
    [new] = (await _emit(clients[-1], "flow.replace", {}))["run_ids"]
    assert (await clients[0].get(f"/v1/runs/{old}")).json()["run"]["status"] == "cancelled"
    await clients[0].post(f"/v1/runs/{new}/cancel", json={"reason": "test over"})


async def test_ingest_side_flow_control_holds_in_total_across_nodes_and_a_node_kill(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    if backend == "postgres":
        db = str(request.getfixturevalue("pg_url"))
    else:
        db = str(tmp_path / 'state' / 'ironflow.db')
    ports = [free_port()] if backend == "sqlite" else [free_port(), free_port()]
    nodes = [
        await start_node(db, tmp_path / f"n{i}", tmp_path, node_id=f"n{i}", port=port)
        for i, port in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    # The worker lives on the last node: on PostgreSQL the first is the one killed.
    worker = Proc([sys.executable, str(FLOW_WORKER), urls[-1]], tmp_path / "worker.log")
    procs = [*nodes, worker]
    try:
        await worker.wait_line("READY")
        clients = [httpx.AsyncClient(base_url=url, timeout=30) for url in urls]
        async with trio.open_nursery() as nursery:
            for scenario in (_rate_limit, _debounce, _debounce_max_wait, _singleton):
                nursery.start_soon(scenario, clients, db)
            # A batch of 100 from 250 events at full rate, a node killed while
            # the second batch fills: nothing is lost, one run per batch.
            first = await _emit_all(clients, "flow.bulk", [{"n": i} for i in range(150)])
        nodes[0].signal(signal.SIGKILL)
        await nodes[0].wait_exit()
        if backend == "sqlite":  # the only node: back on the same file and port
            nodes[0] = await start_node(db, tmp_path / "n0", tmp_path, node_id="n0", port=ports[0])
            procs.append(nodes[0])
        later = await _emit_all(clients[-1:], "flow.bulk", [{"n": i} for i in range(150, 250)])
        assert all(a["batched"] for a in first + later)
        runs = await _until(
            lambda: (r := _runs(db, "bulk")) and len(r) == 3
            and all(x["status"] == "completed" for x in r) and r,
            "three completed batch runs", timeout=60,
        )
        sizes = sorted(len(r["output"]["n"]) for r in runs)
        assert sizes == [50, 100, 100]
        assert sorted(n for r in runs for n in r["output"]["n"]) == list(range(250))
        for client in clients:
            await client.aclose()
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
