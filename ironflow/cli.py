"""The ``ironflow`` command line: run a node, emit events, inspect runs.

``ironflow serve`` builds a :class:`~ironflow.config.NodeConfig` from flags,
``IRONFLOW_*`` variables and an optional YAML file, then runs the node under
``trio.run``. Every other command is a thin synchronous HTTP client of the
node's ``/v1`` API (see ``docs/http-api.md``): it prints aligned tables for
people and, with ``--json``, the API's own JSON for scripts.

Exit codes: 0 success; 1 the engine refused the request or could not be
reached; 2 bad usage (unknown flag, malformed ``--data``, invalid config).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click
import httpx

from ironflow.config import (
    BOOTSTRAP_KEY_FILE,
    DEFAULT_PORT,
    DEFAULT_SERVER_URL,
    DEFAULT_STATE_DIR,
    DEV_TIMINGS,
    ConfigError,
    Limits,
    NodeConfig,
    Timings,
    load_config,
    redact_url,
)

# Generous: a cancel or an emit is one transaction, but a loaded node may queue it.
HTTP_TIMEOUT_S = 30.0
# Outputs and event data are shown in full with --json; tables keep rows readable.
CELL_MAX = 60
# Exit codes.
EXIT_FAILURE = 1
EXIT_USAGE = 2


# ── errors ──────────────────────────────────────────────────────────────────


class CliFailure(click.ClickException):
    """Printed as ``error: <message>`` (plus optional hint lines) on stderr."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, hints: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.hints = list(hints)

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)
        for hint in self.hints:
            click.echo(f"hint: {hint}", err=True)


class UsageFailure(CliFailure):
    """Bad input from the caller (malformed --data, invalid config): exit code 2."""

    exit_code = EXIT_USAGE


def _usage_failure(message: str) -> NoReturn:
    raise UsageFailure(message)


# ── HTTP client ─────────────────────────────────────────────────────────────


class EngineClient:
    """A synchronous client of one node's ``/v1`` API.

    Args:
      server: base URL such as ``http://localhost:9123``.
      api_key: sent as ``Authorization: Bearer <key>`` when given.
      transport: an httpx transport (tests pass ``httpx.MockTransport``).

    Every failure becomes a :class:`CliFailure`: an error answer carries the
    HTTP status and the body's ``code``/``message``; a refused connection says
    how to start a node.
    """

    def __init__(
        self, server: str, api_key: str | None, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.server = server.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.server, headers=headers, timeout=HTTP_TIMEOUT_S, transport=transport
        )

    def close(self) -> None:
        self._client.close()

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        return self._request("GET", path, params=clean)

    def post(self, path: str, body: Any) -> Any:
        return self._request("POST", path, json=body)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise CliFailure(
                f'cannot reach the engine at {self.server} (is "ironflow serve --dev" running?)'
            ) from None
        except httpx.TimeoutException as exc:
            raise CliFailure(
                f"the engine at {self.server} did not answer in time ({exc})"
            ) from None
        except httpx.HTTPError as exc:
            raise CliFailure(f"request to {self.server} failed: {exc}") from None
        if response.is_error:
            raise self._failure(response)
        try:
            return response.json()
        except ValueError:
            raise CliFailure(
                f"the engine at {self.server} answered {method} {path} with non-JSON content"
            ) from None

    def _failure(self, response: httpx.Response) -> CliFailure:
        try:
            body = response.json()
            code, message = str(body["code"]), str(body["message"])
        except (ValueError, KeyError, TypeError):
            code = response.reason_phrase.upper().replace(" ", "_") or "HTTP_ERROR"
            message = response.text.strip()[:200] or "(empty answer)"
        hints: list[str] = []
        if response.status_code == 401:
            hints.append("pass an API key with --api-key or IRONFLOW_API_KEY")
            key_path = Path(os.environ.get("IRONFLOW_STATE_DIR") or DEFAULT_STATE_DIR) / BOOTSTRAP_KEY_FILE
            if key_path.exists():
                hints.append(
                    f"a --dev node wrote an org admin key to {key_path} "
                    '(its "key" field); it is not used automatically'
                )
        elif response.status_code == 403 and "platform" in message:
            hints.append(
                "this needs a platform key (ifplatform_…); with database access mint the first "
                "one with: ironflow keys create --platform --db .ironflow/ironflow.db"
            )
        return CliFailure(f"{code}: {message} (HTTP {response.status_code})", hints=hints)


def _client(ctx: click.Context, server: str | None, api_key: str | None) -> EngineClient:
    """The client for a command: its own -s/--api-key win over the group's."""
    obj = ctx.ensure_object(dict)
    client = EngineClient(
        server or obj.get("server") or DEFAULT_SERVER_URL,
        api_key or obj.get("api_key"),
        transport=obj.get("transport"),
    )
    ctx.call_on_close(client.close)
    return client


# ── formatting ──────────────────────────────────────────────────────────────


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, empty: str) -> None:
    """Print rows under headers with aligned columns (the last column is not padded)."""
    if not rows:
        click.echo(empty)
        return
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        click.echo("  ".join(padded).rstrip())


def _compact(value: Any, limit: int = CELL_MAX) -> str:
    """One-line JSON of ``value``, truncated to ``limit`` characters."""
    if value is None:
        return "-"
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    )
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _span(seconds: float) -> str:
    """A short human span: 0.4s, 12.3s, 4m, 2h, 3d."""
    seconds = abs(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _ago(ts: float | None, now: float) -> str:
    """``3s ago`` for a past epoch timestamp, ``in 3s`` for a future one."""
    if ts is None:
        return "-"
    delta = now - ts
    if -0.05 < delta < 1:
        return "just now"
    return f"{_span(delta)} ago" if delta > 0 else f"in {_span(delta)}"


def _countdown(seconds: float | None, *, past: str = "now") -> str:
    """``in 12.3s`` for a positive count of seconds; ``past`` otherwise."""
    if seconds is None:
        return "-"
    if seconds <= 0:
        return past
    return f"in {seconds:.1f}s" if seconds < 60 else f"in {_span(seconds)}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def _duration_ms(start: float | None, end: float | None) -> str:
    if start is None or end is None:
        return "-"
    return _ms((end - start) * 1000.0)


# ── the group ───────────────────────────────────────────────────────────────


def _server_option(envvar: bool) -> Callable[[Any], Any]:
    return click.option(
        "-s",
        "--server",
        envvar="IRONFLOW_SERVER_URL" if envvar else None,
        default=DEFAULT_SERVER_URL if envvar else None,
        show_default=envvar,
        help="Engine URL (env IRONFLOW_SERVER_URL).",
    )


def _api_key_option(envvar: bool) -> Callable[[Any], Any]:
    return click.option(
        "--api-key",
        envvar="IRONFLOW_API_KEY" if envvar else None,
        default=None,
        help="API key: ifkey_… (org) or ifplatform_… (platform) (env IRONFLOW_API_KEY).",
    )


def _json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")(func)


def client_command(group: click.Group, name: str, **kwargs: Any) -> Callable[[Any], Any]:
    """A command of ``group`` that also accepts -s/--server and --api-key itself."""

    def decorate(func: Callable[..., Any]) -> Any:
        func = _api_key_option(envvar=False)(func)
        func = _server_option(envvar=False)(func)
        return group.command(name, **kwargs)(click.pass_context(func))

    return decorate


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@_server_option(envvar=True)
@_api_key_option(envvar=True)
@click.version_option(package_name="ironflow-py", prog_name="ironflow")
@click.pass_context
def main(ctx: click.Context, server: str, api_key: str | None) -> None:
    """Ironflow in Python: a durable-execution engine.

    Start a local node with `ironflow serve --dev`, run a worker, then
    `ironflow emit NAME --data '{...}'` and `ironflow runs get RUN_ID`.
    """
    obj = ctx.ensure_object(dict)
    obj.setdefault("server", server)
    obj.setdefault("api_key", api_key)


# ── serve ───────────────────────────────────────────────────────────────────


def _timing_flag(field: str) -> str:
    """``lease_expiry_s`` → ``--lease-expiry``."""
    name = field[:-2] if field.endswith("_s") else field
    return "--" + name.replace("_", "-")


def _timing_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One flag per field of :class:`Timings`, seed default and --dev value in its help."""
    defaults = Timings()
    for field in reversed(Timings.__struct_fields__):
        default = getattr(defaults, field)
        is_int = isinstance(default, int) and not isinstance(default, bool)
        unit = "Count" if is_int else "Seconds"
        dev = DEV_TIMINGS.get(field)
        dev_note = f", --dev {dev:g}" if dev is not None else ""
        func = click.option(
            _timing_flag(field),
            field,
            type=int if is_int else float,
            default=None,
            metavar="N" if is_int else "SECONDS",
            help=f"{unit} (timings.{field}; default {default:g}{dev_note}).",
        )(func)
    return func


def _limit_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One flag per field of :class:`Limits` (``function_live_s`` → ``--function-live``)."""
    defaults = Limits()
    for field in reversed(Limits.__struct_fields__):
        default = getattr(defaults, field)
        is_int = isinstance(default, int)
        func = click.option(
            _timing_flag(field),
            field,
            type=int if is_int else float,
            default=None,
            metavar="N" if is_int else "SECONDS",
            help=f"{'Count' if is_int else 'Seconds'} (limits.{field}; default {default:g}).",
        )(func)
    return func


def _banner(config: NodeConfig) -> list[str]:
    host = config.host
    shown = "localhost" if host in ("127.0.0.1", "0.0.0.0", "::", "") else host
    lines = [f"ironflow: engine node starting on http://{shown}:{config.port}"]
    kind = "PostgreSQL" if config.is_postgres else "SQLite"
    lines.append(f"ironflow: database {redact_url(config.database_url)} ({kind})")
    if config.dev:
        t = config.timings
        lines.append(
            "ironflow: --dev: org endpoints need no API key; loop-1 timings shortened "
            f"(heartbeat {t.heartbeat_interval_s:g} s, lease {t.lease_expiry_s:g} s, "
            f"scanner {t.scanner_interval_s:g} s, grace {t.recovery_grace_s:g} s)"
        )
    lines.append("ironflow: Ctrl-C drains workers; a second Ctrl-C stops at once")
    return lines


def _serve_node(config: NodeConfig) -> None:
    """Run the node until it drains (imported late: the node pulls in the web stack)."""
    import trio

    from ironflow import logs, node

    logs.setup(config.log_level)
    trio.run(node.serve, config)


@main.command()
@click.option(
    "--dev", is_flag=True, help="Local development: no key for org endpoints, short timings."
)
@click.option(
    "--db", default=None, help="SQLite path or postgresql:// URL (env IRONFLOW_DATABASE_URL)."
)
@click.option("--host", default=None, help="Interface to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help=f"Port to bind (default {DEFAULT_PORT}).")
@click.option("--node-id", default=None, help="Stable node id (default: hostname + random suffix).")
@click.option(
    "-f",
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML config file (top-level NodeConfig fields, timings under 'timings:').",
)
@click.option(
    "--state-dir",
    default=None,
    help="Where the SQLite default and dev key live (default .ironflow).",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default=None,
    help="Log level (default INFO).",
)
@_timing_options
@_limit_options
def serve(
    dev: bool,
    db: str | None,
    host: str | None,
    port: int | None,
    node_id: str | None,
    config_file: str | None,
    state_dir: str | None,
    log_level: str | None,
    **flags: Any,
) -> None:
    """Run an engine node (Ctrl-C drains, a second Ctrl-C stops).

    Precedence, lowest first: seed defaults, --dev, the -f file, IRONFLOW_*
    variables, flags. Leases, sessions and stale-claim thresholds must be at
    least 2x the heartbeat interval.
    """
    try:
        config = load_config(
            file=config_file,
            dev=dev,
            overrides={
                "db": db,
                "host": host,
                "port": port,
                "node_id": node_id,
                "state_dir": state_dir,
                "log_level": log_level.upper() if log_level else None,
            },
            timing_overrides={k: v for k, v in flags.items() if k in Timings.__struct_fields__},
            limit_overrides={k: v for k, v in flags.items() if k in Limits.__struct_fields__},
        )
    except ConfigError as exc:
        _usage_failure(str(exc))
    for line in _banner(config):
        click.echo(line, err=True)
    try:
        _serve_node(config)
    except KeyboardInterrupt:  # only before the node's signal receiver is open
        click.echo("ironflow: interrupted", err=True)
        sys.exit(130)


# ── emit ────────────────────────────────────────────────────────────────────


def _load_data(data: str | None, data_file: str | None) -> Any:
    if data is not None and data_file is not None:
        _usage_failure("give either --data or --data-file, not both")
    if data_file is not None:
        try:
            text = sys.stdin.read() if data_file == "-" else Path(data_file).read_text()
        except OSError as exc:
            _usage_failure(f"cannot read --data-file {data_file}: {exc.strerror or exc}")
        source = f"--data-file {data_file}"
    elif data is not None:
        text, source = data, "--data"
    else:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        _usage_failure(f"{source} is not valid JSON: {exc}")


@client_command(main, "emit")
@click.argument("name")
@click.option("--data", default=None, help="Event data as JSON (default {}).")
@click.option(
    "--data-file", default=None, help="Read the event data (JSON) from a file, '-' for stdin."
)
@click.option("--idempotency-key", default=None, help="A repeat within the window creates nothing.")
@_json_option
def emit(
    ctx: click.Context,
    server: str | None,
    api_key: str | None,
    name: str,
    data: str | None,
    data_file: str | None,
    idempotency_key: str | None,
    as_json: bool,
) -> None:
    """Emit event NAME; print its id and the runs it started."""
    payload = _load_data(data, data_file)
    body: dict[str, Any] = {"name": name, "data": payload}
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    answer = _client(ctx, server, api_key).post("/v1/events", body)
    if as_json:
        _echo_json(answer)
        return
    click.echo(
        f"event  {answer['event_id']}"
        + ("  (duplicate: nothing new created)" if answer.get("duplicate") else "")
    )
    run_ids = answer.get("run_ids") or []
    if run_ids:
        for run_id in run_ids:
            click.echo(f"run    {run_id}")
    else:
        click.echo("runs   none (no registered function is triggered by this event)")


# ── runs ────────────────────────────────────────────────────────────────────


@main.group()
def runs() -> None:
    """List, inspect and cancel runs."""


@client_command(runs, "list")
@click.option(
    "--status", default=None, help="waiting_for_capacity|running|waiting|completed|failed|cancelled"
)
@click.option("--function", "function_id", default=None, help="Only runs of this function id.")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@_json_option
def runs_list(
    ctx: click.Context,
    server: str | None,
    api_key: str | None,
    status: str | None,
    function_id: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List runs, newest first."""
    answer = _client(ctx, server, api_key).get(
        "/v1/runs", {"status": status, "function": function_id, "limit": limit}
    )
    if as_json:
        _echo_json(answer)
        return
    now = time.time()
    rows = [
        [
            r["id"],
            r["function_id"],
            r["status"],
            f"{r['attempt']}/{r['max_attempts']}",
            r["recovery_count"],
            r["current_execution_seq"],
            _ago(r["created_at"], now),
            _duration_ms(r.get("started_at"), r.get("ended_at")),
        ]
        for r in answer.get("runs", [])
    ]
    _table(
        ["RUN", "FUNCTION", "STATUS", "ATTEMPT", "RECOVERIES", "SEQ", "CREATED", "DURATION"],
        rows,
        empty="no runs",
    )


def _print_run_detail(detail: dict[str, Any]) -> None:
    run = detail["run"]
    now = detail.get("db_now") or time.time()
    error = run.get("error")
    fields: list[tuple[str, Any]] = [
        ("run", run["id"]),
        ("function", run["function_id"]),
        ("status", run["status"]),
        ("attempt", f"{run['attempt']}/{run['max_attempts']}"),
        ("recovery_count", run["recovery_count"]),
        ("execution_seq", run["current_execution_seq"]),
        ("event", run.get("event_id")),
    ]
    if run.get("parent_run_id"):
        fields.append(("parent run", run["parent_run_id"]))
    if run.get("concurrency_key"):
        fields.append(("concurrency key", run["concurrency_key"]))
    fields += [
        ("created", _ago(run["created_at"], now)),
        ("started", _ago(run.get("started_at"), now)),
        ("ended", _ago(run.get("ended_at"), now)),
        ("duration", _duration_ms(run.get("started_at"), run.get("ended_at"))),
    ]
    if detail.get("waiting_reason"):
        fields.append(("waiting", detail["waiting_reason"]))
    queue = detail.get("queue")
    if queue:
        reserved = (
            f", reserved by session {queue['reservation_owner']}"
            if queue.get("reservation_owner")
            else ""
        )
        fields.append(
            (
                "queued",
                f"seq {queue['execution_seq']} ({queue['reason']}), eligible "
                f"{_countdown(queue.get('eligible_in_s'))}{reserved}",
            )
        )
    lease = detail.get("lease")
    if lease:
        fields.append(
            (
                "lease",
                f"seq {lease['execution_seq']} on session {lease['session_id']} (node {lease['node_id']}), "
                f"expires {_countdown(lease.get('expires_in_s'), past='now (expired)')}",
            )
        )
    if run.get("output") is not None:
        fields.append(("output", _compact(run["output"], 400)))
    if error:
        fields.append(("error", f"{error.get('code', 'ERROR')}: {error.get('message', '')}"))
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {'-' if value is None else value}")
    if error and error.get("traceback"):
        click.echo("traceback:")
        for line in str(error["traceback"]).rstrip().splitlines():
            click.echo(f"  {line}")
    click.echo("")
    steps = detail.get("steps") or []
    rows = []
    for s in steps:
        shown = s.get("output")
        if s.get("error"):
            shown = f"{s['error'].get('code', 'ERROR')}: {s['error'].get('message', '')}"
        elif s.get("status") == "sleeping" and s.get("wake_at"):
            shown = f"wakes {_ago(s['wake_at'], now)}"
        rows.append(
            [
                s["step_id"],
                s["name"],
                s["kind"],
                s["status"],
                _ms(s.get("duration_ms")),
                _compact(shown),
            ]
        )
    _table(["STEP ID", "NAME", "KIND", "STATUS", "DURATION", "OUTPUT"], rows, empty="no steps yet")


@client_command(runs, "get")
@click.argument("run_id")
@_json_option
def runs_get(
    ctx: click.Context, server: str | None, api_key: str | None, run_id: str, as_json: bool
) -> None:
    """Show one run: counters, output or error, why it waits, and its steps."""
    answer = _client(ctx, server, api_key).get(f"/v1/runs/{run_id}")
    if as_json:
        _echo_json(answer)
        return
    _print_run_detail(answer)


@client_command(runs, "cancel")
@click.argument("run_id")
@click.option("--reason", default=None, help="Recorded with the cancellation.")
@_json_option
def runs_cancel(
    ctx: click.Context,
    server: str | None,
    api_key: str | None,
    run_id: str,
    reason: str | None,
    as_json: bool,
) -> None:
    """Cancel a run that has not ended."""
    body = {"reason": reason} if reason is not None else {}
    answer = _client(ctx, server, api_key).post(f"/v1/runs/{run_id}/cancel", body)
    if as_json:
        _echo_json(answer)
        return
    click.echo(f"run {answer.get('run_id', run_id)} {answer.get('status', 'cancelled')}")


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


class Duration(click.ParamType):
    """``90``, ``90s``, ``15m``, ``12h``, ``3d`` or ``2w`` → seconds (positive)."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        text = str(value).strip().lower()
        unit = _DURATION_UNITS.get(text[-1:], None)
        number = text[:-1] if unit is not None else text
        try:
            seconds = float(number) * (unit or 1.0)
        except ValueError:
            self.fail(f"{value!r} is not a duration such as 90s, 15m, 12h or 3d", param, ctx)
        if not seconds > 0:
            self.fail(f"{value!r} must be a positive duration", param, ctx)
        return seconds


@client_command(runs, "purge")
@click.option(
    "--older-than",
    "older_than_s",
    type=Duration(),
    required=True,
    help="Delete finished runs that ended longer ago than this (90s, 15m, 12h, 3d, 2w).",
)
@click.option(
    "--status",
    "statuses",
    type=click.Choice(["completed", "failed", "cancelled"]),
    multiple=True,
    help="Only runs that ended this way (repeatable; default all three).",
)
@_json_option
def runs_purge(
    ctx: click.Context,
    server: str | None,
    api_key: str | None,
    older_than_s: float,
    statuses: tuple[str, ...],
    as_json: bool,
) -> None:
    """Delete finished runs now, with their steps and audit rows (platform key).

    Events go too once past the idempotency window and no kept run needs them.
    Runs that have not ended, and children of kept runs, always stay.
    """
    body: dict[str, Any] = {"older_than_s": older_than_s}
    if statuses:
        body["statuses"] = list(statuses)
    answer = _client(ctx, server, api_key).post("/v1/runs/purge", body)
    if as_json:
        _echo_json(answer)
        return
    click.echo(
        f"purged {answer['runs']} runs, {answer['steps']} steps, {answer['audit']} audit rows"
        f" and {answer['events']} events (ended more than {_span(older_than_s)} ago)"
    )


# ── functions ───────────────────────────────────────────────────────────────


@main.group()
def functions() -> None:
    """Functions registered by workers."""


@client_command(functions, "list")
@click.option(
    "--all", "show_all", is_flag=True,
    help="Also functions no worker registered within limits.function_live_s.",
)
@_json_option
def functions_list(
    ctx: click.Context, server: str | None, api_key: str | None, as_json: bool, show_all: bool
) -> None:
    """List live functions (registered by a worker recently) and their triggers."""
    answer = _client(ctx, server, api_key).get("/v1/functions", params={"all": "true"} if show_all else None)
    if as_json:
        _echo_json(answer)
        return
    now = time.time()
    rows = []
    for f in answer.get("functions", []):
        d = f["definition"]
        triggers = ", ".join(t["event"] for t in d.get("triggers") or []) or "-"
        conc = d.get("concurrency")
        concurrency = (
            "-"
            if not conc
            else f"{conc['limit']}" + (f" per {conc['key']}" if conc.get("key") else "")
        )
        retries = (d.get("retries") or {}).get("max_attempts", "-")
        seen = f.get("last_seen_at") or f.get("updated_at")
        row = [f["id"], triggers, retries, concurrency, f["version"], _ago(seen, now)]
        rows.append([*row, "yes" if f.get("live", True) else "no"] if show_all else row)
    _table(
        ["FUNCTION", "TRIGGERS", "MAX ATTEMPTS", "CONCURRENCY", "VERSION", "LAST REGISTERED"]
        + (["LIVE"] if show_all else []),
        rows,
        empty="no functions registered (start a worker)",
    )


# ── capacity ────────────────────────────────────────────────────────────────


@main.group()
def capacity() -> None:
    """Leases, worker sessions and the dispatch queue (platform key only)."""


@client_command(capacity, "leases")
@_json_option
def capacity_leases(
    ctx: click.Context, server: str | None, api_key: str | None, as_json: bool
) -> None:
    """Concurrency leases of executing segments."""
    answer = _client(ctx, server, api_key).get("/v1/capacity/leases")
    if as_json:
        _echo_json(answer)
        return
    now = time.time()
    rows = [
        [
            lease["run_id"],
            lease["function_id"],
            lease["execution_seq"],
            lease["session_id"],
            lease["node_id"],
            _ago(lease.get("activated_at"), now),
            _countdown(lease.get("expires_in_s"), past="expired"),
        ]
        for lease in answer.get("leases", [])
    ]
    _table(
        ["RUN", "FUNCTION", "SEQ", "SESSION", "NODE", "ACTIVATED", "EXPIRES"],
        rows,
        empty="no leases",
    )


@client_command(capacity, "sessions")
@_json_option
def capacity_sessions(
    ctx: click.Context, server: str | None, api_key: str | None, as_json: bool
) -> None:
    """Connected worker sessions and their credits."""
    answer = _client(ctx, server, api_key).get("/v1/capacity/sessions")
    if as_json:
        _echo_json(answer)
        return
    now = time.time()
    rows = [
        [
            s["session_id"],
            s["worker_id"],
            s["node_id"],
            s["mode"],
            f"{s['credits_claimed']}/{s['max_concurrent_jobs']}",
            s["credits_held"],
            "yes" if s["draining"] else "no",
            _countdown(s["expires_at"] - now, past="expired"),
            _compact(", ".join(s.get("function_ids") or []) or None),
        ]
        for s in answer.get("sessions", [])
    ]
    _table(
        ["SESSION", "WORKER", "NODE", "MODE", "BUSY", "HELD", "DRAINING", "EXPIRES", "FUNCTIONS"],
        rows,
        empty="no worker sessions",
    )


@client_command(capacity, "queue")
@_json_option
def capacity_queue(
    ctx: click.Context, server: str | None, api_key: str | None, as_json: bool
) -> None:
    """Runnable segments waiting for a worker (with their recovery-grace countdown)."""
    answer = _client(ctx, server, api_key).get("/v1/capacity/queue")
    if as_json:
        _echo_json(answer)
        return
    now = time.time()
    rows = [
        [
            q["run_id"],
            q["function_id"],
            q["execution_seq"],
            q["reason"],
            _countdown(q.get("eligible_in_s")),
            q.get("reservation_owner"),
            _ago(q.get("enqueued_at"), now),
        ]
        for q in answer.get("queue", [])
    ]
    _table(
        ["RUN", "FUNCTION", "SEQ", "REASON", "ELIGIBLE", "RESERVED BY", "ENQUEUED"],
        rows,
        empty="queue empty",
    )


# ── audit ───────────────────────────────────────────────────────────────────


@main.group()
def audit() -> None:
    """The audit log (recoveries are always recorded)."""


@client_command(audit, "list")
@click.option("--run", "run_id", default=None, help="Only events of this run.")
@click.option(
    "--type", "type_", default=None, help="Only this event type, e.g. capacity.segment.recovered."
)
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@_json_option
def audit_list(
    ctx: click.Context,
    server: str | None,
    api_key: str | None,
    run_id: str | None,
    type_: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List audit events, newest first."""
    answer = _client(ctx, server, api_key).get(
        "/v1/audit", {"run_id": run_id, "type": type_, "limit": limit}
    )
    if as_json:
        _echo_json(answer)
        return
    now = time.time()
    rows = [
        [
            _ago(e["at"], now),
            e["type"],
            e.get("run_id"),
            e.get("function_id"),
            _compact(e.get("data")),
        ]
        for e in answer.get("events", [])
    ]
    _table(["AT", "TYPE", "RUN", "FUNCTION", "DATA"], rows, empty="no audit events")


# ── keys ────────────────────────────────────────────────────────────────────


@main.group()
def keys() -> None:
    """API keys."""


def _open_store(url: str) -> Any:
    from ironflow.store import open_store

    return open_store(url)


def _mint_in_database(url: str, kind: str, role: str) -> tuple[str, str]:
    """Create a key directly in the database (for the first platform key)."""
    import trio

    is_sqlite_path = "://" not in url and not url.startswith("file:")
    if is_sqlite_path and not Path(url).exists():
        raise UsageFailure(f"no database at {url} (start the engine once, or pass the right --db)")

    async def mint() -> tuple[str, str]:
        store = _open_store(url)
        await store.open()
        try:
            key_id, key = await store.create_api_key(kind, role)
        finally:
            await store.close()
        return str(key_id), str(key)

    try:
        return trio.run(mint)
    except CliFailure:
        raise
    except Exception as exc:  # any driver error: report it, do not dump a traceback
        raise CliFailure(f"cannot create the key in {redact_url(url)}: {exc}") from None


@client_command(keys, "create")
@click.option(
    "--platform", is_flag=True, help="A platform key (ifplatform_…) instead of an org key."
)
@click.option("--role", default="admin", show_default=True, help="Role of the new key.")
@click.option(
    "--db",
    default=None,
    help="Mint straight in this database (SQLite path or postgresql:// URL) instead of "
    "asking the engine; how the first platform key is made.",
)
@_json_option
def keys_create(
    ctx: click.Context,
    server: str | None,
    api_key: str | None,
    platform: bool,
    role: str,
    db: str | None,
    as_json: bool,
) -> None:
    """Create an API key and print it once.

    Without --db the engine mints it (POST /v1/keys) for the caller's key: an
    org admin key can create org keys; only a platform key can create another
    platform key.
    """
    kind = "platform" if platform else "org"
    if db is not None:
        key_id, key = _mint_in_database(db, kind, role)
        answer: dict[str, Any] = {"id": key_id, "key": key, "kind": kind, "role": role}
    else:
        answer = _client(ctx, server, api_key).post(
            "/v1/keys", {"platform": platform, "role": role}
        )
    if as_json:
        _echo_json(answer)
    else:
        click.echo(
            f"created {answer.get('kind', kind)} key {answer['id']} (role {answer.get('role', role)}):",
            err=True,
        )
        click.echo(answer["key"])
    click.echo("warning: the key is not shown again; store it now.", err=True)


if __name__ == "__main__":  # pragma: no cover
    main(prog_name="ironflow")
