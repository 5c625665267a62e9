"""A full concurrency key's ``on_limit`` through the HTTP API
(docs/flow-control.md): ``skip`` and ``cancel_in_progress`` with real node
and worker processes (tests/procs/on_limit_worker.py) — across two nodes on
PostgreSQL (the count holds in total), one on SQLite — and bad input refused
on both registration paths."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

from ironflow.node import Node
from ironflow.protocol import Concurrency, Debounce, FunctionDef, Refused, Register, Trigger
from tests.integration.helpers import raw_worker, wait_for_run
from tests.integration.procs import ROOT, Proc, node_ports, start_nodes
from tests.integration.test_flow_control import _emit_all

WORKER = ROOT / "tests" / "procs" / "on_limit_worker.py"


def _skipped(metrics_text: str) -> float:
    found = re.search(
        r'^ironflow_flow_events_total\{mechanism="concurrency",outcome="skipped"\} (\S+)$', metrics_text, re.M
    )
    return float(found.group(1)) if found else 0.0


async def _skip(clients: list[httpx.AsyncClient]) -> None:
    answers = await _emit_all(clients, "gate.go", [{"account": 1}] * 10)
    started = [a for a in answers if a["run_ids"]]
    skipped = [a for a in answers if a["skipped"]]
    assert len(started) == 1 and len(skipped) == 9, answers
    [run_id] = started[0]["run_ids"]
    assert {(a["skipped"][0]["mechanism"], a["skipped"][0]["run_id"]) for a in skipped} == {("concurrency", run_id)}
    record = (await clients[-1].get(f"/v1/events/{skipped[0]['event_id']}")).json()
    assert record["run_ids"] == [] and record["flow"][0]["reason"].endswith("1/1 in flight")
    counted = sum([_skipped((await c.get("/metrics")).text) for c in clients])
    assert counted == 9
    await wait_for_run(clients[0], run_id, timeout=10)
    assert len((await _emit_all(clients, "gate.go", [{"account": 1}]))[0]["run_ids"]) == 1


async def _cancel_in_progress(clients: list[httpx.AsyncClient]) -> None:
    [old] = (await _emit_all(clients[:1], "latest.go", [{"hold": 60}]))[0]["run_ids"]
    await wait_for_run(clients[0], old, "running", timeout=10)
    [new] = (await _emit_all(clients[-1:], "latest.go", [{"hold": 0}]))[0]["run_ids"]
    assert (await clients[0].get(f"/v1/runs/{old}")).json()["run"]["status"] == "cancelled"
    # The worker's one slot was the old run's: the new one completes only
    # because the worker was told to stop it.
    done = await wait_for_run(clients[0], new, timeout=10)
    assert done["run"]["status"] == "completed" and done["run"]["output"] == {"hold": 0}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_skip_and_cancel_in_progress_hold_across_nodes_through_the_api(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    db = str(request.getfixturevalue("pg_url")) if backend == "postgres" else str(tmp_path / "ironflow.db")
    ports = node_ports(backend)
    procs: list[Proc] = []
    try:
        await start_nodes(db, tmp_path, ports, procs)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        procs.append(Proc([sys.executable, str(WORKER), urls[-1]], tmp_path / "worker.log"))
        await procs[-1].wait_line("READY")
        clients = [httpx.AsyncClient(base_url=url, timeout=30) for url in urls]
        try:
            await _skip(clients)  # one slot: one scenario at a time
            await _cancel_in_progress(clients)
        finally:
            for client in clients:
                await client.aclose()
    finally:
        for proc in procs:
            proc.stop()


BAD = [
    ({"limit": 2, "on_limit": "sometimes"}, 400, "on_limit"),
    ({"on_limit": "skip"}, 400, "limit"),
    ([{"limit": 9, "on_limit": "skip"}, {"limit": 1, "key": "k", "on_limit": "cancel_in_progress"}],
     422, "on_limit other than 'queue'"),
]


# The checks are the engine's, before the store: one backend proves them.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_bad_on_limit_is_refused_on_the_pull_register_and_the_websocket(
    node: Node, http: httpx.AsyncClient
) -> None:
    for concurrency, status, named in BAD:
        fd = {"id": "f", "triggers": [{"event": "e"}], "concurrency": concurrency}
        resp = await http.post("/v1/worker/register", json={"worker_id": "p", "functions": [fd]})
        assert resp.status_code == status and named in resp.json()["message"], resp.text
    combined = FunctionDef(
        id="f", triggers=[Trigger("e")], debounce=Debounce(5.0),
        concurrency=Concurrency(1, on_limit="skip"),
    )
    resp = await http.post(
        "/v1/worker/register", json={"worker_id": "p", "functions": [msgspec.to_builtins(combined)]}
    )
    assert resp.status_code == 422 and "concurrency.on_limit='skip' cannot be combined with debounce" in resp.text
    async with raw_worker(node.url, None, register=False) as raw:
        await raw.send(Register(worker_id="w", functions=[combined]))
        refused = await raw.receive_type(Refused)
        assert refused.code == "REGISTRATION_REFUSED" and "concurrency.on_limit" in refused.message
    assert (await http.get("/v1/functions?all=1")).json()["functions"] == []
