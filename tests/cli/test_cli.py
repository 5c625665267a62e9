"""The ``ironflow`` command line without a running node.

Configuration errors, argument parsing and output formatting are checked with
click's CliRunner; HTTP answers come from an ``httpx.MockTransport`` handed to
the group through ``obj={"transport": ...}``. End-to-end tests against a real
node live with the integration tests.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from ironflow import cli
from ironflow.cli import keys as keys_cli
from ironflow.cli import render
from ironflow.cli import serve as serve_cli
from ironflow.config import NodeConfig, Timings

Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No IRONFLOW_* variable from the developer's shell, and a cwd without .ironflow/."""
    import os

    for var in list(os.environ):
        if var.startswith("IRONFLOW_"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    yield


def run(args: list[str], handler: Handler | None = None, **kwargs: Any) -> Result:
    obj: dict[str, Any] = {}
    if handler is not None:
        obj["transport"] = httpx.MockTransport(handler)
    return CliRunner().invoke(cli.main, args, obj=obj, **kwargs)


def must_not_call(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"unexpected request {request.method} {request.url}")


def answer(status: int, body: Any) -> Handler:
    """A handler answering every request with ``body``; requests land in ``.seen``."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json=body)

    handler.seen = seen  # type: ignore[attr-defined]
    return handler


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ── serve ───────────────────────────────────────────────────────────────────


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[NodeConfig]:
    """Capture the config `serve` would run the node with, instead of running it."""
    configs: list[NodeConfig] = []
    monkeypatch.setattr(serve_cli, "serve_node", configs.append)
    return configs


def test_serve_with_unsafe_timing_exits_2_with_the_config_error(served: list[NodeConfig]) -> None:
    result = run(["serve", "--lease-expiry", "1"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: timings.lease_expiry_s=1s must be at least 2×")
    assert served == []


def test_serve_processes_on_sqlite_exits_2_naming_its_single_writer(
    served: list[NodeConfig], tmp_path: Path
) -> None:
    result = run(["serve", "--processes", "2", "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --processes needs PostgreSQL: SQLite has one writer")
    assert served == [] and not (tmp_path / "x.db").exists()


def test_serve_processes_below_one_is_a_usage_error(served: list[NodeConfig]) -> None:
    result = run(["serve", "--processes", "0"])
    assert result.exit_code == 2 and "--processes" in result.stderr
    assert served == []


def test_serve_with_non_numeric_timing_is_a_usage_error(served: list[NodeConfig]) -> None:
    result = run(["serve", "--heartbeat-interval", "soon"])
    assert result.exit_code == 2
    assert "timings.heartbeat_interval_s='soon' is not a duration" in result.stderr
    assert served == []


def test_serve_timing_flags_take_the_seeds_duration_forms(served: list[NodeConfig]) -> None:
    result = run(["serve", "--lease-expiry", "2m", "--recovery-grace", "250ms", "--stale-claim-threshold", "1m30s"])
    assert result.exit_code == 0, result.stderr
    t = served[0].timings
    assert (t.lease_expiry_s, t.recovery_grace_s, t.stale_claim_threshold_s) == (120, 0.25, 90)


def test_serve_with_unreadable_config_file_exits_2(
    served: list[NodeConfig], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    result = run(["serve", "-f", str(bad)])
    assert result.exit_code == 2
    assert "error: cannot read config file" in result.stderr


def test_serve_dev_banner_names_url_database_and_short_timings(served: list[NodeConfig]) -> None:
    result = run(["serve", "--dev"])
    assert result.exit_code == 0, result.output
    (config,) = served
    assert config.dev and config.timings.heartbeat_interval_s == 2.0
    assert "http://localhost:9123" in result.stderr
    assert ".ironflow/ironflow.db (SQLite)" in result.stderr
    assert "heartbeat 2 s, lease 6 s, scanner 1 s, grace 1 s" in result.stderr
    assert result.stdout == ""


def test_serve_flags_reach_the_node_config(served: list[NodeConfig]) -> None:
    result = run(
        [
            "serve",
            "--dev",
            "--db",
            "state/x.db",
            "--host",
            "0.0.0.0",
            "--port",
            "9200",
            "--node-id",
            "node-a",
            "--state-dir",
            "state",
            "--log-level",
            "debug",
            "--lease-expiry",
            "10",
            "--recovery-ceiling",
            "3",
            "--drain-timeout",
            "5",
        ]
    )
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.db, config.host, config.port, config.node_id) == (
        "state/x.db",
        "0.0.0.0",
        9200,
        "node-a",
    )
    assert (config.state_dir, config.log_level) == ("state", "DEBUG")
    assert config.timings.lease_expiry_s == 10.0
    assert config.timings.heartbeat_interval_s == 2.0  # --dev value kept
    assert config.timings.recovery_ceiling == 3
    assert config.timings.drain_timeout_s == 5.0


def test_serve_flag_beats_environment_and_yaml(
    served: list[NodeConfig], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "ironflow.yaml"
    path.write_text("port: 9300\ntimings:\n  lease_expiry_s: 200\n  recovery_grace_s: 7\n")
    monkeypatch.setenv("IRONFLOW_LEASE_EXPIRY_S", "150")
    result = run(["serve", "-f", str(path), "--lease-expiry", "120"])
    assert result.exit_code == 0, result.output
    (config,) = served
    assert config.port == 9300
    assert config.timings.lease_expiry_s == 120.0
    assert config.timings.recovery_grace_s == 7.0


def test_postgres_url_is_shown_without_its_password(served: list[NodeConfig]) -> None:
    result = run(["serve", "--db", "postgresql://ironflow:s3cret@db:5432/ironflow"])
    assert result.exit_code == 0, result.output
    assert "postgresql://***@db:5432/ironflow (PostgreSQL)" in result.stderr
    assert "s3cret" not in result.stderr


@pytest.mark.parametrize("field", Timings.__struct_fields__)
def test_every_timing_has_a_serve_flag(served: list[NodeConfig], field: str) -> None:
    value = getattr(Timings(), field) + 1  # distinct from the default, still valid
    result = run(["serve", serve_cli.timing_flag(field), str(value)])
    assert result.exit_code == 0, result.output
    assert getattr(served[0].timings, field) == value


def test_python_m_ironflow_goes_through_serve(
    served: list[NodeConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["ironflow", "serve", "--dev", "--port", "9555"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("ironflow", run_name="__main__")
    assert exit_info.value.code == 0
    assert served[0].port == 9555 and served[0].dev


# ── emit ────────────────────────────────────────────────────────────────────


def test_emit_with_bad_json_exits_2_without_calling_the_engine() -> None:
    result = run(["emit", "order.created", "--data", "{not json"], must_not_call)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --data is not valid JSON")


def test_emit_with_bad_data_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "d.json").write_text("[1, 2")
    result = run(["emit", "x", "--data-file", "d.json"], must_not_call)
    assert result.exit_code == 2
    assert "error: --data-file d.json is not valid JSON" in result.stderr
    missing = run(["emit", "x", "--data-file", "nope.json"], must_not_call)
    assert missing.exit_code == 2
    assert "cannot read --data-file nope.json" in missing.stderr


def test_emit_refuses_data_and_data_file_together() -> None:
    result = run(["emit", "x", "--data", "{}", "--data-file", "f"], must_not_call)
    assert result.exit_code == 2
    assert "either --data or --data-file" in result.stderr


def test_emit_posts_the_event_and_prints_event_and_run_ids() -> None:
    handler = answer(201, {"event_id": "evt_1", "run_ids": ["run_a", "run_b"], "duplicate": False})
    result = run(["emit", "deploy.demo", "--data", '{"n": 1}', "--idempotency-key", "k1"], handler)
    assert result.exit_code == 0, result.output
    (request,) = handler.seen  # type: ignore[attr-defined]
    assert (request.method, request.url.path) == ("POST", "/v1/events")
    assert json.loads(request.content) == {
        "name": "deploy.demo",
        "data": {"n": 1},
        "idempotency_key": "k1",
    }
    assert "evt_1" in result.stdout and "run_a" in result.stdout and "run_b" in result.stdout


def test_emit_defaults_data_to_an_empty_object() -> None:
    handler = answer(201, {"event_id": "evt_1", "run_ids": [], "duplicate": False})
    result = run(["emit", "nobody.listens"], handler)
    assert result.exit_code == 0, result.output
    assert json.loads(handler.seen[0].content) == {"name": "nobody.listens", "data": {}}  # type: ignore[attr-defined]
    assert "no registered function" in result.stdout


# ── reaching the engine ─────────────────────────────────────────────────────


def test_unreachable_server_exits_1_with_a_hint() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = run(["runs", "list", "-s", url])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f'error: cannot reach the engine at {url} (is "ironflow serve --dev" running?)'
    )


def test_server_comes_from_flag_then_group_then_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(f"{request.url.host}:{request.url.port}")
        return httpx.Response(200, json={"runs": []})

    monkeypatch.setenv("IRONFLOW_SERVER_URL", "http://env-host:1111")
    assert run(["runs", "list"], handler).exit_code == 0
    assert run(["-s", "http://group-host:2222", "runs", "list"], handler).exit_code == 0
    assert (
        run(
            ["-s", "http://group-host:2222", "runs", "list", "-s", "http://cmd:3333"], handler
        ).exit_code
        == 0
    )
    assert hosts == ["env-host:1111", "group-host:2222", "cmd:3333"]


def test_default_server_is_localhost_9123() -> None:
    handler = answer(200, {"functions": []})
    assert run(["functions", "list"], handler).exit_code == 0
    assert str(handler.seen[0].url) == "http://localhost:9123/v1/functions"  # type: ignore[attr-defined]


def test_api_key_is_sent_as_bearer_and_read_from_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handler = answer(200, {"runs": []})
    run(["runs", "list", "--api-key", "ifkey_flag"], handler)
    monkeypatch.setenv("IRONFLOW_API_KEY", "ifkey_env")
    run(["runs", "list"], handler)
    seen = handler.seen  # type: ignore[attr-defined]
    assert [r.headers.get("authorization") for r in seen] == [
        "Bearer ifkey_flag",
        "Bearer ifkey_env",
    ]


def test_no_key_is_sent_even_when_a_dev_bootstrap_key_exists(tmp_path: Path) -> None:
    (tmp_path / ".ironflow").mkdir()
    (tmp_path / ".ironflow" / ".ironflow_bootstrap_key.json").write_text('{"key": "ifkey_boot"}')
    handler = answer(200, {"runs": []})
    assert run(["runs", "list"], handler).exit_code == 0
    assert "authorization" not in handler.seen[0].headers  # type: ignore[attr-defined]


def test_401_mentions_the_bootstrap_key_file_when_present(tmp_path: Path) -> None:
    handler = answer(401, {"code": "UNAUTHORIZED", "message": "an API key is required"})
    without = run(["runs", "list"], handler)
    assert without.exit_code == 1
    assert "error: UNAUTHORIZED: an API key is required (HTTP 401)" in without.stderr
    assert "bootstrap" not in without.stderr
    (tmp_path / ".ironflow").mkdir()
    (tmp_path / ".ironflow" / ".ironflow_bootstrap_key.json").write_text('{"key": "ifkey_boot"}')
    with_file = run(["runs", "list"], handler)
    assert ".ironflow/.ironflow_bootstrap_key.json" in with_file.stderr


@pytest.mark.parametrize("what", ["leases", "sessions", "queue"])
def test_capacity_without_platform_key_prints_the_403_and_exits_1(what: str) -> None:
    handler = answer(403, {"code": "FORBIDDEN", "message": "platform credentials required here"})
    result = run(["capacity", what], handler)
    assert result.exit_code == 1
    assert "error: FORBIDDEN: platform credentials required here (HTTP 403)" in result.stderr
    assert "keys create --platform --db" in result.stderr
    assert handler.seen[0].url.path == f"/v1/capacity/{what}"  # type: ignore[attr-defined]


def test_error_without_json_body_still_names_the_status() -> None:
    result = run(["runs", "get", "r1"], lambda request: httpx.Response(502, text="bad gateway"))
    assert result.exit_code == 1
    assert "(HTTP 502)" in result.stderr and "bad gateway" in result.stderr


# ── read commands ───────────────────────────────────────────────────────────


def _run_record(**overrides: Any) -> dict[str, Any]:
    now = time.time()
    record = {
        "id": "run_01",
        "function_id": "deploy-demo",
        "event_id": "evt_01",
        "parent_run_id": None,
        "status": "completed",
        "attempt": 1,
        "max_attempts": 3,
        "recovery_count": 1,
        "current_execution_seq": 2,
        "output": {"processed": True},
        "error": None,
        "created_at": now - 3.2,
        "started_at": now - 3.0,
        "ended_at": now - 2.75,
        "concurrency_key": None,
    }
    record.update(overrides)
    return record


def test_runs_list_passes_filters_and_prints_an_aligned_table() -> None:
    handler = answer(
        200, {"runs": [_run_record(), _run_record(id="run_0002_long", status="waiting")]}
    )
    result = run(
        ["runs", "list", "--status", "completed", "--function", "deploy-demo", "--limit", "5"],
        handler,
    )
    assert result.exit_code == 0, result.output
    params = handler.seen[0].url.params  # type: ignore[attr-defined]
    assert dict(params) == {"status": "completed", "function": "deploy-demo", "limit": "5"}
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "RUN",
        "FUNCTION",
        "STATUS",
        "ATTEMPT",
        "RECOVERIES",
        "SEQ",
        "CREATED",
        "DURATION",
    ]
    status_column = lines[0].index("FUNCTION")
    assert all(line[status_column:].startswith("deploy-demo") for line in lines[1:])
    assert "1/3" in lines[1] and "3.2s ago" in lines[1] and "250 ms" in lines[1]


def test_runs_list_json_prints_the_api_answer() -> None:
    body = {"runs": [_run_record()]}
    result = run(["runs", "list", "--json"], answer(200, body))
    assert result.exit_code == 0
    assert json.loads(result.stdout) == body


def test_runs_get_shows_counters_waiting_reason_error_and_steps() -> None:
    now = time.time()
    detail = {
        "run": _run_record(
            status="waiting",
            output=None,
            ended_at=None,
            error={
                "message": "boom",
                "code": "HANDLER_ERROR",
                "traceback": "Traceback\n  line 1",
                "retryable": True,
            },
        ),
        "steps": [
            {
                "run_id": "run_01",
                "step_id": "process-order",
                "name": "process-order",
                "kind": "run",
                "status": "completed",
                "output": {"payload": "x" * 200},
                "error": None,
                "duration_ms": 15012.4,
                "execution_seq": 1,
                "created_at": now - 2,
                "wake_at": None,
            }
        ],
        "queue": {
            "run_id": "run_01",
            "function_id": "deploy-demo",
            "execution_seq": 2,
            "eligible_at": now + 12.3,
            "reason": "recovery",
            "enqueued_at": now - 1,
            "reservation_owner": None,
            "reservation_expires_at": None,
            "eligible_in_s": 12.3,
        },
        "lease": None,
        "waiting_reason": "recovery grace until 12:00:00",
        "db_now": now,
    }
    result = run(["runs", "get", "run_01"], answer(200, detail))
    assert result.exit_code == 0, result.output
    out = result.stdout
    for expected in (
        "deploy-demo",
        "waiting",
        "1/3",
        "recovery_count",
        "execution_seq",
        "recovery grace until 12:00:00",
        "eligible in 12.3s",
        "HANDLER_ERROR: boom",
        "  line 1",
        "STEP ID",
        "process-order",
        "15012 ms",
    ):
        assert expected in out, expected
    step_line = next(line for line in out.splitlines() if line.startswith("process-order"))
    assert step_line.endswith("…") and len(step_line) < 160


def test_capacity_queue_shows_eligible_at_as_a_countdown() -> None:
    now = time.time()
    rows = [
        {
            "run_id": "run_01",
            "function_id": "f",
            "execution_seq": 3,
            "eligible_at": now + 12.34,
            "reason": "recovery",
            "enqueued_at": now - 5,
            "reservation_owner": None,
            "reservation_expires_at": None,
            "eligible_in_s": 12.34,
        },
        {
            "run_id": "run_02",
            "function_id": "f",
            "execution_seq": 1,
            "eligible_at": now - 1,
            "reason": "new",
            "enqueued_at": now - 1,
            "reservation_owner": "sess_1",
            "reservation_expires_at": now + 20,
            "eligible_in_s": -1.0,
        },
    ]
    result = run(["capacity", "queue", "--api-key", "ifplatform_x"], answer(200, {"queue": rows}))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "in 12.3s" in lines[1] and "recovery" in lines[1]
    assert " now " in lines[2] and "sess_1" in lines[2]


def test_capacity_leases_show_when_they_expire() -> None:
    now = time.time()
    lease = {
        "run_id": "run_01",
        "function_id": "f",
        "execution_seq": 1,
        "session_id": "sess_1",
        "node_id": "node-a",
        "expires_at": now + 4,
        "activated_at": now - 2,
        "expires_in_s": 4.0,
    }
    result = run(["capacity", "leases"], answer(200, {"leases": [lease]}))
    assert result.exit_code == 0, result.output
    assert "EXPIRES" in result.stdout and "in 4.0s" in result.stdout


def test_capacity_leases_all_asks_for_unreaped_ones_and_marks_them() -> None:
    now = time.time()
    lease = {
        "run_id": "run_01", "function_id": "f", "execution_seq": 1, "session_id": "sess_1",
        "node_id": "node-a", "expires_at": now - 3, "activated_at": now - 90, "expires_in_s": -3.0,
        "expired": True,
    }
    handler = answer(200, {"leases": [lease]})
    result = run(["capacity", "leases", "--all"], handler)
    assert result.exit_code == 0, result.output
    assert handler.seen[0].url.params["all"] == "true"  # type: ignore[attr-defined]
    assert "expired, not yet reaped" in result.stdout
    plain = answer(200, {"leases": []})
    assert run(["capacity", "leases"], plain).exit_code == 0
    assert "all" not in plain.seen[0].url.params  # type: ignore[attr-defined]


def test_functions_list_and_audit_list() -> None:
    functions = {
        "functions": [
            {
                "id": "deploy-demo",
                "definition": {
                    "id": "deploy-demo",
                    "triggers": [{"event": "deploy.demo"}],
                    "retries": {"max_attempts": 3},
                    "concurrency": {"limit": 2, "key": "customer.id"},
                },
                "version": 1,
                "updated_at": time.time(),
            }
        ]
    }
    result = run(["functions", "list"], answer(200, functions))
    assert result.exit_code == 0, result.output
    assert "deploy.demo" in result.stdout and "2 per customer.id" in result.stdout

    handler = answer(
        200,
        {
            "events": [
                {
                    "id": "a1",
                    "at": time.time(),
                    "type": "capacity.segment.recovered",
                    "run_id": "run_01",
                    "function_id": "f",
                    "data": {"seq": 2},
                }
            ]
        },
    )
    result = run(
        ["audit", "list", "--run", "run_01", "--type", "capacity.segment.recovered"], handler
    )
    assert result.exit_code == 0, result.output
    assert dict(handler.seen[0].url.params) == {  # type: ignore[attr-defined]
        "run_id": "run_01",
        "type": "capacity.segment.recovered",
        "limit": "100",
        "include": "data",  # the audit list shows each entry's data
    }
    assert "capacity.segment.recovered" in result.stdout


def test_runs_cancel_sends_the_reason() -> None:
    handler = answer(200, {"run_id": "run_01", "status": "cancelled"})
    result = run(["runs", "cancel", "run_01", "--reason", "bad deploy"], handler)
    assert result.exit_code == 0, result.output
    request = handler.seen[0]  # type: ignore[attr-defined]
    assert request.url.path == "/v1/runs/run_01/cancel"
    assert json.loads(request.content) == {"reason": "bad deploy"}
    assert "run_01 cancelled" in result.stdout


def _resumed(run_id: str, **overrides: Any) -> dict[str, Any]:
    body = {"run_id": run_id, "function_id": "checkout", "execution_seq": 3, "resumed_from": "failed",
            "from_step": "charge", "steps_deleted": 2, "status": "waiting_for_capacity"}
    return {**body, **overrides}


def test_runs_resume_in_bulk_pages_through_every_failed_run_and_counts_them() -> None:
    """``runs resume --function F --status failed --since 1h`` (docs/run-control.md)."""
    pages = [
        {"resumed": [_resumed("run_a"), _resumed("run_b")], "next_cursor": "1.5|run_b"},
        {"resumed": [_resumed("run_c", from_step=None, steps_deleted=0)], "next_cursor": None},
    ]
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("POST", "/v1/runs/resume")
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=pages[len(seen) - 1])

    result = run(["runs", "resume", "--function", "checkout", "--status", "failed", "--since", "1h",
                  "--limit", "2"], handler)
    assert result.exit_code == 0, result.output
    assert seen == [
        {"since_s": 3600.0, "function_id": "checkout", "limit": 2},
        {"since_s": 3600.0, "function_id": "checkout", "limit": 2, "cursor": "1.5|run_b"},
    ]
    assert result.stdout.splitlines() == [
        "run run_a resumed (was failed) from step 'charge' (2 step rows to run again)",
        "run run_b resumed (was failed) from step 'charge' (2 step rows to run again)",
        "run run_c resumed (was failed)",
        "resumed 3 runs",
    ]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run_a", "--since", "1h"], "not both"),
        ([], "give a RUN_ID, or --since"),
        (["--since", "1h", "--from-step", "charge"], "--from-step needs a RUN_ID"),
        (["--since", "1h", "--status", "completed"], "Invalid value for '--status'"),
        (["--since", "soon"], "--since"),
    ],
)
def test_runs_resume_refuses_mixed_or_missing_arguments_without_calling_the_engine(
    args: list[str], says: str
) -> None:
    result = run(["runs", "resume", *args], must_not_call)
    assert result.exit_code != 0 and says in result.output, result.output


def test_runs_resume_says_when_the_run_went_back_on_its_parked_step() -> None:
    handler = answer(200, _resumed("run_a", resumed_from="paused", from_step=None, steps_deleted=0, status="waiting"))
    result = run(["runs", "resume", "run_a"], handler)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        "run run_a resumed (was paused); waiting on its parked step (a sleep or wait not over yet)"
    )


def test_empty_lists_say_so() -> None:
    assert "no runs" in run(["runs", "list"], answer(200, {"runs": []})).stdout


# ── keys ────────────────────────────────────────────────────────────────────


def test_keys_create_over_http_prints_the_key_once_with_a_warning() -> None:
    handler = answer(
        201, {"id": "ak_1", "key": "ifplatform_abc", "kind": "platform", "role": "admin"}
    )
    result = run(["keys", "create", "--platform", "--api-key", "ifplatform_old"], handler)
    assert result.exit_code == 0, result.output
    assert json.loads(handler.seen[0].content) == {"platform": True, "role": "admin"}  # type: ignore[attr-defined]
    assert result.stdout.strip() == "ifplatform_abc"
    assert "not shown again" in result.stderr


class FakeStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.calls: list[str] = []

    async def open(self) -> None:
        self.calls.append("open")

    async def create_api_key(self, kind: str, role: str) -> tuple[str, str]:
        self.calls.append(f"create {kind} {role}")
        return "ak_9", f"if{kind}_fresh"

    async def close(self) -> None:
        self.calls.append("close")


def test_keys_create_with_db_mints_in_the_database(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stores: list[FakeStore] = []

    def open_store(url: str) -> FakeStore:
        stores.append(FakeStore(url))
        return stores[-1]

    monkeypatch.setattr(keys_cli, "_open_store", open_store)
    (tmp_path / "ironflow.db").write_bytes(b"")
    result = run(["keys", "create", "--platform", "--db", "ironflow.db"], must_not_call)
    assert result.exit_code == 0, result.output
    assert stores[0].url == "ironflow.db"
    assert stores[0].calls == ["open", "create platform admin", "close"]
    assert result.stdout.strip() == "ifplatform_fresh"
    assert "not shown again" in result.stderr


def test_keys_create_with_missing_sqlite_file_refuses() -> None:
    result = run(["keys", "create", "--platform", "--db", "nowhere/ironflow.db"], must_not_call)
    assert result.exit_code == 2
    assert "no database at nowhere/ironflow.db" in result.stderr


def test_keys_create_directly_in_a_real_sqlite_store(tmp_path: Path) -> None:
    import trio

    from ironflow.store import open_store

    db = str(tmp_path / "real.db")

    async def init() -> None:
        store = open_store(db)
        await store.open()
        await store.close()

    trio.run(init)
    result = run(["keys", "create", "--platform", "--db", db, "--json"], must_not_call)
    assert result.exit_code == 0, result.output
    created = json.loads(result.stdout)
    assert created["key"].startswith("ifplatform_") and created["kind"] == "platform"

    async def check() -> str | None:
        store = open_store(db)
        await store.open()
        try:
            principal = await store.authenticate(created["key"])
        finally:
            await store.close()
        return None if principal is None else principal.kind

    assert trio.run(check) == "platform"


# ── formatting helpers ──────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        (0.2, "just now"),
        (3.0, "3.0s ago"),
        (42.0, "42s ago"),
        (300.0, "5m ago"),
        (7200.0, "2h ago"),
        (-5.0, "in 5.0s"),
    ],
)
def test_relative_times(delta: float, expected: str) -> None:
    assert render.ago(1000.0 - delta, 1000.0) == expected


def test_countdown_and_durations() -> None:
    assert render.countdown(12.34) == "in 12.3s"
    assert render.countdown(-0.5) == "now"
    assert render.countdown(-0.5, past="expired") == "expired"
    assert render.ms(3.14159) == "3.1 ms"
    assert render.ms(1234.5) == "1234 ms"
    assert render.ms(None) == "-"


# ── runs purge ──────────────────────────────────────────────────────────────


def test_runs_purge_sends_older_than_in_seconds_and_the_statuses_and_prints_counts() -> None:
    handler = answer(200, {"runs": 3, "steps": 9, "audit": 2, "events": 1, "older_than_s": 259200})
    result = run(
        ["runs", "purge", "--older-than", "3d", "--status", "completed", "--status", "cancelled",
         "--api-key", "ifplatform_x"],
        handler,
    )
    assert result.exit_code == 0, result.output
    (request,) = handler.seen  # type: ignore[attr-defined]
    assert request.method == "POST" and request.url.path == "/v1/runs/purge"
    assert json.loads(request.content) == {
        "older_than_s": 259200.0, "statuses": ["completed", "cancelled"]
    }
    assert request.headers["Authorization"] == "Bearer ifplatform_x"
    assert result.stdout.strip() == (
        "purged 3 runs, 9 steps, 2 audit rows and 1 events (ended more than 3d ago)"
    )


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("90s", 90.0), ("15m", 900.0), ("12h", 43200.0), ("2w", 1209600.0)])
def test_runs_purge_reads_durations_with_units(text: str, seconds: float) -> None:
    handler = answer(200, {"runs": 0, "steps": 0, "audit": 0, "events": 0, "older_than_s": seconds})
    assert run(["runs", "purge", "--older-than", text], handler).exit_code == 0
    assert json.loads(handler.seen[0].content) == {"older_than_s": seconds}  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", ["soon", "0", "-3d", "3y"])
def test_runs_purge_with_a_bad_duration_exits_2_without_calling_the_engine(bad: str) -> None:
    result = run(["runs", "purge", "--older-than", bad], must_not_call)
    assert result.exit_code == 2
    assert "--older-than" in result.stderr


def test_runs_purge_refuses_a_status_that_is_not_finished() -> None:
    result = run(["runs", "purge", "--older-than", "1d", "--status", "running"], must_not_call)
    assert result.exit_code == 2


def test_runs_purge_without_platform_key_prints_the_403_and_exits_1() -> None:
    handler = answer(403, {"code": "FORBIDDEN", "message": "platform credentials required here"})
    result = run(["runs", "purge", "--older-than", "3d"], handler)
    assert result.exit_code == 1
    assert "error: FORBIDDEN: platform credentials required here (HTTP 403)" in result.stderr


def test_serve_chaos_flag_turns_on_the_chaos_routes_and_says_so(served: list[NodeConfig]) -> None:
    result = run(["serve", "--dev", "--chaos"])
    assert result.exit_code == 0, result.output
    (config,) = served
    assert config.chaos is True
    assert "--chaos: platform keys may crash this node's actors" in result.output


def test_serve_without_chaos_flag_keeps_chaos_off(served: list[NodeConfig]) -> None:
    result = run(["serve", "--dev"])
    assert result.exit_code == 0 and served[0].chaos is False
    assert "--chaos" not in result.output


def test_runs_list_prints_how_to_read_the_next_page_and_sends_the_cursor() -> None:
    handler = answer(200, {"runs": [], "next_cursor": "abc123"})
    result = run(["runs", "list", "--cursor", "prev456", "--limit", "5"], handler)
    assert result.exit_code == 0, result.output
    params = dict(handler.seen[0].url.params)  # type: ignore[attr-defined]
    assert params["cursor"] == "prev456" and params["limit"] == "5" and "include" not in params
    assert "more: ironflow runs list --cursor abc123" in result.stdout
    last = run(["runs", "list"], answer(200, {"runs": [], "next_cursor": None}))
    assert "more:" not in last.stdout
