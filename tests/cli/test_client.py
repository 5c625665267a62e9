"""The client the CLI talks through: the SDK's IronflowSync, the calls it
sends, and how the CLI turns each kind of failure into a message and exit 1.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
from click.testing import CliRunner, Result

import ironflow.cli
from ironflow.protocol import ErrorInfo, RunDetail
from ironflow.sdk import calls
from ironflow.sdk.client import Ironflow, IronflowSync
from ironflow.sdk.errors import IronflowAPIError

CLI_DIR = Path(ironflow.cli.__file__).parent


def run_detail() -> dict[str, Any]:
    now = time.time()
    return {
        "run": {
            "id": "run_01", "function_id": "f", "event_id": None, "parent_run_id": None,
            "status": "failed", "attempt": 3, "max_attempts": 3, "recovery_count": 0,
            "current_execution_seq": 3, "output": None,
            "error": {"message": "boom", "code": "HANDLER_ERROR", "traceback": None, "retryable": True},
            "created_at": now - 9, "started_at": now - 8, "ended_at": now - 1,
            "concurrency_key": None,
        },
        "steps": [], "queue": None, "lease": None, "waiting_reason": None, "db_now": now,
    }


def invoke(args: list[str], handler: Any) -> Result:
    obj = {"transport": httpx.MockTransport(handler)}
    return CliRunner().invoke(ironflow.cli.main, args, obj=obj)


# ── the SDK's sync client ───────────────────────────────────────────────────


def test_sync_client_decodes_an_answer_into_the_protocol_record_and_keeps_its_bytes() -> None:
    body = run_detail()
    client = IronflowSync(
        "http://node.test", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=body))
    )
    with client:
        answer = client.request(calls.get_run("run_01"))
    assert isinstance(answer.value, RunDetail)
    assert answer.value.run.error == ErrorInfo("boom", "HANDLER_ERROR")
    assert json.loads(answer.content) == body


def test_sync_client_raises_the_api_errors_status_code_and_message() -> None:
    body = {"code": "RUN_NOT_FOUND", "message": "no run run_x"}
    transport = httpx.MockTransport(lambda r: httpx.Response(404, json=body))
    with IronflowSync("http://node.test", transport=transport) as client:
        with pytest.raises(IronflowAPIError) as caught:
            client.request(calls.get_run("run_x"))
    assert (caught.value.status, caught.value.code, caught.value.message) == (
        404, "RUN_NOT_FOUND", "no run run_x",
    )


def test_an_error_page_that_is_not_json_is_named_by_its_reason_phrase() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(502, text="  upstream down\n"))
    with IronflowSync("http://node.test", transport=transport) as client:
        with pytest.raises(IronflowAPIError) as caught:
            client.request(calls.list_runs())
    assert (caught.value.code, caught.value.message) == ("BAD_GATEWAY", "upstream down")


def test_the_sync_and_async_clients_send_the_same_request_for_one_call() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"runs": []})

    transport = httpx.MockTransport(handler)
    with IronflowSync("http://node.test", "ifkey_k", transport=transport) as sync_client:
        sync_client.request(calls.list_runs(status="failed", limit=5))

    async def send_async() -> None:
        async with Ironflow("http://node.test", "ifkey_k", transport=transport) as client:
            await client.request(calls.list_runs(status="failed", limit=5))

    trio.run(send_async)
    first, second = ((r.method, str(r.url), r.content, dict(r.headers)) for r in seen)
    assert first == second
    assert first[1] == "http://node.test/v1/runs?status=failed&limit=5"


def test_the_async_client_returns_protocol_records() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json=run_detail()))

    async def get() -> RunDetail:
        async with Ironflow("http://node.test", transport=transport) as client:
            return await client.get_run("run_01")

    assert trio.run(get).run.status == "failed"


def test_call_bodies_leave_out_fields_that_are_none() -> None:
    assert calls.emit("x").content() == b'{"name":"x","data":{}}'
    assert calls.purge_runs(60.0).content() == b'{"older_than_s":60.0}'
    both = calls.purge_runs(60.0, ["failed"]).content()
    assert msgspec.json.decode(both or b"") == {"older_than_s": 60.0, "statuses": ["failed"]}
    assert calls.list_audit(limit=3).query() == {"limit": 3}


# ── the CLI's failures ──────────────────────────────────────────────────────


def test_an_answer_that_is_not_the_documented_record_exits_1_naming_the_record() -> None:
    result = invoke(["runs", "get", "run_01"], lambda r: httpx.Response(200, json={"nope": 1}))
    assert result.exit_code == 1
    assert result.stderr.startswith(
        "error: the engine at http://localhost:9123 answered GET /v1/runs/run_01 "
        "with something other than a RunDetail"
    )


def test_an_engine_that_does_not_answer_in_time_exits_1() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    result = invoke(["functions", "list"], handler)
    assert result.exit_code == 1
    assert "error: the engine at http://localhost:9123 did not answer in time" in result.stderr


def test_json_prints_the_api_answer_as_sent_even_fields_this_cli_does_not_know() -> None:
    body = run_detail()
    body["run"]["from_a_newer_node"] = {"kept": True}
    result = invoke(["runs", "get", "run_01", "--json"], lambda r: httpx.Response(200, json=body))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == body


def test_a_403_without_platform_in_its_message_has_no_platform_hint() -> None:
    body = {"code": "FORBIDDEN", "message": "role viewer cannot cancel"}
    result = invoke(["runs", "cancel", "run_01"], lambda r: httpx.Response(403, json=body))
    assert result.exit_code == 1
    assert result.stderr == "error: FORBIDDEN: role viewer cannot cancel (HTTP 403)\n"


# ── import boundaries ───────────────────────────────────────────────────────


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _reaches(names: set[str], package: str) -> bool:
    return any(name == package or name.startswith(package + ".") for name in names)


@pytest.mark.parametrize("path", sorted(CLI_DIR.glob("*.py")), ids=lambda p: p.name)
def test_only_serve_reaches_the_node_and_only_keys_the_store(path: Path) -> None:
    names = _imports(path)
    assert _reaches(names, "ironflow.node") == (path.name == "serve.py")
    assert _reaches(names, "ironflow.store") == (path.name == "keys.py")
    assert not _reaches(names, "ironflow.api") and not _reaches(names, "actors")


def test_the_node_does_not_import_the_cli_except_in_its_entry_point() -> None:
    # ``python -m ironflow.node`` is ``ironflow serve``: its main() (run only
    # as the program) is the one place the node may reach the CLI.
    tree = ast.parse((CLI_DIR.parent / "node.py").read_text())
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    outside = ast.Module(body=[n for n in tree.body if n is not entry], type_ignores=[])
    names: set[str] = set()
    for node in ast.walk(outside):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    assert not _reaches(names, "ironflow.cli")
    probe = "import sys, ironflow.node; print([m for m in sys.modules if m.startswith('ironflow.cli')])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_loading_the_cli_loads_neither_the_node_nor_the_store_nor_the_web_stack() -> None:
    probe = (
        "import sys, ironflow.cli; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('quart', 'hypercorn', 'actors') "
        "or m.startswith(('ironflow.node', 'ironflow.store', 'ironflow.api'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
