"""Compensation through real worker processes (docs/compensation.md).

``saga3`` (tests/procs/compensate_worker.py) reserves, charges, and fails to
ship for good: its undos run newest-first, and the worker is killed (-9)
between the two — after ``refund`` was recorded, inside ``release``. A new
worker runs ``release`` and nothing else: each undo ran once, the failed step
did not run again, the run ends ``failed`` with the original error. Then a
``hold`` run waiting for an event is cancelled with ``ironflow runs cancel``:
its failing undo is recorded, the other still runs, the run ends ``cancelled``.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from click.testing import CliRunner

from ironflow.cli import main
from ironflow.node import Node
from tests.integration.helpers import eventually
from tests.integration.procs import ROOT, Proc

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "procs" / "compensate_worker.py"


async def start(procs: list[Proc], url: str, effects: Path, gate: Path, log: Path) -> Proc:
    proc = Proc([sys.executable, str(WORKER), url, str(effects), str(gate)], log)
    procs.append(proc)
    await proc.wait_line("READY")
    return proc


def effects_of(path: Path, run_id: str) -> list[tuple[str, int]]:
    """(what, pid) of each side effect of ``run_id``, in order."""
    if not path.exists():
        return []
    return [(w, int(pid)) for r, w, pid in (line.split() for line in path.read_text().splitlines()) if r == run_id]


async def detail(http: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    return (await http.get(f"/v1/runs/{run_id}")).json()


async def ended(http: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        d = await detail(http, run_id)
        return d if d["run"]["status"] in ("completed", "failed", "cancelled") else None

    return await eventually(check, timeout=12, message=f"run {run_id} ended")


def steps_of(d: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["status"] for s in d["steps"]}


async def cli(url: str, *args: str) -> str:
    result = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["--server", url, *args], catch_exceptions=False)
    )
    assert result.exit_code == 0, result.output
    return result.output


async def test_undos_run_once_across_a_kill_9_and_a_cancel_compensates(
    node: Node, http: httpx.AsyncClient, tmp_path: Path, procs: list[Proc]
) -> None:
    effects, gate = tmp_path / "effects", tmp_path / "gate"
    a = await start(procs, node.url, effects, gate, tmp_path / "a.log")
    run_id = (await http.post("/v1/events", json={"name": "saga.go", "data": {}})).json()["run_ids"][0]

    async def killable() -> bool:
        # refund recorded, release running on a: between the two undos.
        refunded = steps_of(await detail(http, run_id)).get("compensate:refund") == "completed"
        return refunded and ("release-start", a.pid) in effects_of(effects, run_id)

    await eventually(killable, timeout=10, message="refund recorded and release started")
    a.signal(signal.SIGKILL)
    gate.touch()
    b = await start(procs, node.url, effects, gate, tmp_path / "b.log")
    d = await ended(http, run_id)

    run = d["run"]
    assert run["status"] == "failed", d
    assert (run["error"]["message"], run["error"]["code"]) == ("step 'ship' failed: no courier today", "NON_RETRYABLE")
    assert run["recovery_count"] >= 1  # the compensation segment was recovered from a
    done = [w for w, _ in effects_of(effects, run_id)]
    # Each step and each undo's effect exactly once; ship (which failed) never again.
    assert sorted(w for w in done if w != "release-start") == sorted(
        ["reserve", "charge", "ship", "refund:ch_1", "release:sku-1"]
    )
    assert effects_of(effects, run_id)[-1] == ("release:sku-1", b.pid)
    assert done.index("refund:ch_1") < done.index("release:sku-1")  # newest first
    assert steps_of(d) == {
        "reserve": "completed", "compensate:registered": "completed", "charge": "completed",
        "ship": "failed", "compensate:begin": "completed", "compensate:refund": "completed",
        "compensate:release": "completed",
    }
    audit = (await http.get("/v1/audit", params={"include": "data", "run_id": run_id, "type": "run.compensated"})).json()
    assert [e["data"] for e in audit["events"]] == [
        {"cause": "failure", "undos_completed": 2, "undos_failed": 0, "error": "NON_RETRYABLE"}
    ]

    # A cancel: the run waits for an event; its undos run, newest first.
    hold_id = (await http.post("/v1/events", json={"name": "hold.go", "data": {}})).json()["run_ids"][0]

    async def waiting() -> bool:
        return steps_of(await detail(http, hold_id)).get("confirm") == "waiting"

    await eventually(waiting, timeout=10, message="hold waiting for its event")
    out = await cli(node.url, "runs", "cancel", hold_id, "--reason", "customer left")
    assert "its undos run now" in out
    d = await ended(http, hold_id)
    assert d["run"]["status"] == "cancelled"
    assert (d["run"]["error"]["message"], d["run"]["error"]["code"]) == ("customer left", "CANCELLED")
    assert [w for w, _ in effects_of(effects, hold_id)] == ["book", "notify", "unbook"]
    assert steps_of(d)["compensate:notify"] == "failed" and steps_of(d)["compensate:unbook"] == "completed"
    shown = await cli(node.url, "runs", "get", hold_id)
    assert "mail server down" in shown  # the failed undo's error, in runs get
