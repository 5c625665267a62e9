"""``python -m ironflow.node`` is the node's own entry point: exactly ``ironflow serve``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.integration.procs import ROOT, Proc, free_port

pytestmark = pytest.mark.slow

# How long a node started as a process gets to answer /readyz.
START_TIMEOUT_S = 30


def _help(*argv: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, *argv, "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return out.splitlines()


def test_python_m_ironflow_node_help_is_ironflow_serve_help() -> None:
    node_help = _help("-m", "ironflow.node")
    serve_help = _help("-m", "ironflow", "serve")
    assert node_help[0] == "Usage: python -m ironflow.node [OPTIONS]"
    assert serve_help[0].endswith(" serve [OPTIONS]")
    assert node_help[1:] == serve_help[1:]
    assert any("--lease-expiry" in line for line in node_help)


async def test_python_m_ironflow_node_serves_an_emit_and_drains_on_sigterm(
    tmp_path: Path, procs: list[Proc]
) -> None:
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "ironflow.node", "--dev", "--db", str(tmp_path / "db.sqlite"),
         "--port", str(port), "--state-dir", str(tmp_path / "state"), "--node-id", "entry"],
        tmp_path / "node.log",
    )
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        with trio.fail_after(START_TIMEOUT_S):
            while True:
                assert proc.alive(), proc.tail()
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)
        r = await client.post("/v1/events", json={"name": "entry.point", "data": {"x": 1}})
        assert r.status_code == 201, r.text
        event_id = r.json()["event_id"]
        listed = (await client.get("/v1/events", params={"name": "entry.point"})).json()
        assert event_id in [e["id"] for e in listed["events"]]
    proc.signal(signal.SIGTERM)
    assert await proc.wait_exit() == 0
    log = proc.log_path.read_text()
    assert "node: serving" in log and "node_id=entry" in log
    assert "Lifespan" not in log  # hypercorn's "ASGI Framework Lifespan error" (hot.py)
