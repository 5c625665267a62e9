"""The light install: ``pip install ironflow-py`` in a fresh venv is a worker, not an engine.

The wheel is built from this checkout and installed with its dependencies
(from pip's configured index and wheel cache) into a venv of its own; the node
runs from the test's own (full) environment. The worker runs under
``asyncio.run`` there: the light install has no Trio at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ironflow.cli.serve import SERVER_EXTRA_HINT
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run
from tests.integration.procs import ROOT, Proc

pytestmark = pytest.mark.slow

# The distributions only the engine needs (the `server` extra), as pip lists them.
SERVER_DISTRIBUTIONS = {
    "trio", "hypercorn", "quart", "quart-trio", "psycopg", "psycopg-binary",
    "prometheus-client",
}

WORKER = """
import asyncio, sys
import ironflow

@ironflow.function(id="light", triggers=[ironflow.event("light.go")])
async def light(ctx):
    a = await ctx.step.run("one", lambda: 20)
    await asyncio.sleep(0)  # an asyncio call in the handler: the worker's own loop
    return {"sum": a + 22, "from": ironflow.__file__, "engine_loaded": sorted(
        m for m in sys.modules if m.split(".")[0] in ("trio", "hypercorn", "quart", "psycopg")
    )}

async def main():
    worker = ironflow.StreamingWorker(sys.argv[1], [light], reconnect_delay=0.2)
    async with worker.running():
        print("READY", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


def _pip(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding only the plain install of this checkout's wheel."""
    tmp = tmp_path_factory.mktemp("light")
    _pip("wheel", "-q", "--no-deps", "-w", str(tmp / "wheels"), str(ROOT))
    (wheel,) = (tmp / "wheels").glob("ironflow_py-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _pip("--python", str(venv / "bin" / "python"), "install", "-q", str(wheel))
    return venv


def test_the_plain_install_lists_none_of_the_engines_packages(light_venv: Path) -> None:
    listed = json.loads(_pip("--python", str(light_venv / "bin" / "python"), "list", "--format=json"))
    names = {p["name"].lower().replace("_", "-") for p in listed}
    assert "ironflow-py" in names and "anyio" in names
    assert not names & SERVER_DISTRIBUTIONS, names & SERVER_DISTRIBUTIONS


def test_ironflow_serve_without_the_server_extra_exits_2_with_one_line_naming_it(
    light_venv: Path,
) -> None:
    out = subprocess.run(
        [str(light_venv / "bin" / "ironflow"), "serve", "--dev"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and SERVER_EXTRA_HINT in lines[0], out.stderr


async def test_a_worker_from_the_plain_install_runs_a_function_on_a_full_node(
    light_venv: Path, node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    script = tmp_path / "light_worker.py"
    script.write_text(WORKER)
    # A script's own folder, not the working directory, heads sys.path: the
    # checkout cannot shadow the installed package (the output says where it came from).
    proc = Proc([str(light_venv / "bin" / "python"), str(script), node.url], tmp_path / "w.log")
    try:
        await proc.wait_line("READY", timeout=30)
        run_id = (await emit(http, "light.go"))["run_ids"][0]
        run = (await wait_for_run(http, run_id, timeout=20))["run"]
        assert run["status"] == "completed", run
        output = run["output"]
        assert output["sum"] == 42 and output["engine_loaded"] == []
        assert output["from"].startswith(str(light_venv)), output["from"]
    finally:
        proc.stop()
