"""The `ironflow` CLI against a real node: emit, runs list/get/cancel, functions, audit, capacity."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio
from click.testing import CliRunner, Result

import ironflow
from ironflow.cli import main
from ironflow.node import Node
from tests.integration.helpers import wait_for_run


async def cli(node: Node, *args: str, key: str | None = None) -> Result:
    """Run the CLI in a thread (it is synchronous; the node shares our event loop)."""
    argv = ["--server", node.url, *(["--api-key", key] if key else []), *args]
    return await trio.to_thread.run_sync(lambda: CliRunner().invoke(main, argv, catch_exceptions=False))


async def test_cli_drives_a_run_from_emit_to_inspection(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    @ironflow.function(id="deploy-demo", triggers=[ironflow.event("deploy.demo")])
    async def process_order(ctx: Any) -> Any:
        return await ctx.step.run("process-order", lambda: {"processed": True})

    worker = ironflow.StreamingWorker(node.url, [process_order], handle_signals=False, max_concurrent_jobs=1)
    await nursery.start(worker.run)

    emitted = await cli(node, "emit", "deploy.demo", "--data", '{"order": 1}', "--json")
    assert emitted.exit_code == 0, emitted.output
    run_id = json.loads(emitted.output)["run_ids"][0]
    await wait_for_run(http, run_id)

    got = await cli(node, "runs", "get", run_id)
    assert got.exit_code == 0, got.output
    for expected in ("completed", "deploy-demo", "process-order", '{"processed":true}'):
        assert expected in got.output, (expected, got.output)
    as_json = json.loads((await cli(node, "runs", "get", run_id, "--json")).output)
    assert as_json["run"]["attempt"] == 1 and as_json["steps"][0]["duration_ms"] is not None

    listed = await cli(node, "runs", "list", "--status", "completed", "--function", "deploy-demo", "--json")
    assert [r["id"] for r in json.loads(listed.output)["runs"]] == [run_id]
    none = await cli(node, "runs", "list", "--status", "failed", "--json")
    assert json.loads(none.output)["runs"] == []

    assert "deploy-demo" in (await cli(node, "functions", "list")).output
    assert (await cli(node, "audit", "list", "--run", run_id)).exit_code == 0

    again = await cli(node, "runs", "cancel", run_id)
    assert again.exit_code == 1 and "CONFLICT" in again.output
    missing = await cli(node, "runs", "get", "run_nope")
    assert missing.exit_code == 1 and "RUN_NOT_FOUND" in missing.output


async def test_cli_capacity_needs_a_platform_key(node: Node) -> None:
    refused = await cli(node, "capacity", "queue", key=node.bootstrap_key)
    assert refused.exit_code == 1 and "platform credentials required here" in refused.output
    _, platform = await node.store.create_api_key("platform", "platform_admin")
    for what in ("leases", "sessions", "queue"):
        ok = await cli(node, "capacity", what, key=platform)
        assert ok.exit_code == 0, ok.output
