"""``ironflow serve``: build a NodeConfig from flags and run a node.

The only CLI module that reaches the node, and it imports ``ironflow.node``
late: the node pulls in the web stack and the store, which no other command
needs.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

import click
import msgspec

from ironflow.cli.errors import CliFailure, usage_failure
from ironflow.config import (
    DEFAULT_PORT,
    DEV_TIMINGS,
    ConfigError,
    Limits,
    NodeConfig,
    Timings,
    load_config,
    redact_url,
)
from ironflow.ids import default_node_id

# What the shell reports for a process stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
# The interpreter's thread switch interval in a node process (default 5 ms).
# The node's database threads (the SQLite writer, the PostgreSQL actors) need
# the GIL back after every statement; with the Trio thread busy they waited up
# to the whole default interval each time. 2 ms measured best of 0.5 / 2 / 5
# ms on SQLite and no worse on PostgreSQL (scripts/bench.py, alternating
# rounds; method in docs/benchmarks.md).
SWITCH_INTERVAL_S = 0.002
# What the engine needs beyond the light install (the `server` extra of
# pyproject.toml), by import name.
SERVER_MODULES = ("trio", "hypercorn", "quart", "quart_trio", "psycopg", "prometheus_client")
SERVER_EXTRA_HINT = "pip install 'ironflow-py[server]'"


def missing_server_modules() -> list[str]:
    """The engine's modules this environment lacks (a light, worker-only install)."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def require_server(command: str) -> None:
    """Exit 2 with one line naming the install when the engine's packages are absent."""
    missing = missing_server_modules()
    if missing:
        usage_failure(
            f"{command} runs the engine, which this install lacks ({', '.join(missing)}):"
            f" {SERVER_EXTRA_HINT}"
        )


def timing_flag(field: str) -> str:
    """``lease_expiry_s`` → ``--lease-expiry``."""
    name = field[:-2] if field.endswith("_s") else field
    return "--" + name.replace("_", "-")


def _struct_options(struct: type[Any], section: str, dev: dict[str, float]) -> Callable[..., Any]:
    """One flag per field of ``struct`` (Timings or Limits), default and --dev value in its help."""
    defaults = struct()

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for field in reversed(struct.__struct_fields__):
            default = getattr(defaults, field)
            is_int = isinstance(default, int) and not isinstance(default, bool)
            # Timings take the seed's duration forms; load_config parses and names a bad one.
            duration = section == "timings" and not is_int
            dev_note = f", --dev {dev[field]:g}" if field in dev else ""
            func = click.option(
                timing_flag(field),
                field,
                type=int if is_int else (str if duration else float),
                default=None,
                metavar="N" if is_int else ("DURATION" if duration else "SECONDS"),
                help=f"{'Count' if is_int else 'Seconds'}"
                f"{' or 90s, 2m, 1m30s, 250ms' if duration else ''} "
                f"({section}.{field}; default {default:g}{dev_note}).",
            )(func)
        return func

    return decorate


def _banner(config: NodeConfig, processes: int) -> list[str]:
    host = config.host
    shown = "localhost" if host in ("127.0.0.1", "0.0.0.0", "::", "") else host
    what = "engine node" if processes == 1 else f"{processes} engine node processes"
    lines = [f"ironflow: {what} starting on http://{shown}:{config.port}"]
    kind = "PostgreSQL" if config.is_postgres else "SQLite"
    lines.append(f"ironflow: database {redact_url(config.database_url)} ({kind})")
    if config.dev:
        t = config.timings
        lines.append(
            "ironflow: --dev: org endpoints need no API key; loop-1 timings shortened "
            f"(heartbeat {t.heartbeat_interval_s:g} s, lease {t.lease_expiry_s:g} s, "
            f"scanner {t.scanner_interval_s:g} s, grace {t.recovery_grace_s:g} s)"
        )
    if config.chaos:
        lines.append(
            "ironflow: --chaos: platform keys may crash this node's actors (testing only)"
        )
    lines.append("ironflow: Ctrl-C drains workers; a second Ctrl-C stops at once")
    return lines


def serve_node(
    config: NodeConfig, *, listen_fd: int | None = None, control_fd: int | None = None
) -> None:
    """Run the node until it drains (imported late: the node pulls in the web stack).

    ``listen_fd`` and ``control_fd``: a member of ``--processes N``
    (``ironflow/cli/processes.py``). A refused start is a :class:`CliFailure`.
    """
    import trio

    from ironflow import logs, node, tracing

    logs.setup(config.log_level)
    traced = tracing.configure_from_env("ironflow-node")
    if traced is not None:
        click.echo(f"ironflow: {traced}", err=True)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        trio.run(partial(node.serve, config, listen_fd=listen_fd, control_fd=control_fd))
    except node.StartRefused as exc:
        raise CliFailure(str(exc)) from exc
    except BaseExceptionGroup as group:  # raised inside the node's signal nursery
        matched, _ = group.split(node.StartRefused)
        if matched is None:
            raise
        refused: BaseException = matched
        while isinstance(refused, BaseExceptionGroup):
            refused = refused.exceptions[0]
        raise CliFailure(str(refused)) from None


def _serve_group(config: NodeConfig, processes: int) -> NoReturn:
    """--processes N: bind the port, print the banner, run the group, exit with its code."""
    _refuse_group(config)
    from ironflow.cli import processes as group

    sockets = group.bind_group(config.host, config.port, processes)
    port = int(sockets[0].getsockname()[1])
    for line in _banner(msgspec.structs.replace(config, port=port), processes):
        click.echo(line, err=True)
    try:
        code = group.serve_group(config, sockets, config.node_id or default_node_id())
    except KeyboardInterrupt:  # only before the group's signal receiver is open
        click.echo("ironflow: interrupted", err=True)
        code = EXIT_INTERRUPTED
    sys.exit(code)


def _refuse_group(config: NodeConfig) -> None:
    """--processes N needs PostgreSQL and SO_REUSEPORT; exit 2 naming why not."""
    if not config.is_postgres:
        usage_failure(
            "--processes needs PostgreSQL: SQLite has one writer, so node processes on one"
            " file would take turns at its lock instead of adding capacity"
            " (use --db postgresql://…, or run one process)"
        )
    if not hasattr(socket, "SO_REUSEPORT"):
        usage_failure("--processes needs SO_REUSEPORT, which this platform lacks")


@click.command()
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
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Node processes sharing the port (PostgreSQL only; ids <node-id>-1 … -N).",
)
@click.option(
    "--chaos",
    is_flag=True,
    default=None,
    help="Testing only: let platform keys crash this node's actors (POST /v1/chaos/crash).",
)
@_struct_options(Timings, "timings", DEV_TIMINGS)
@_struct_options(Limits, "limits", {})
def serve(
    dev: bool,
    chaos: bool | None,
    db: str | None,
    host: str | None,
    port: int | None,
    node_id: str | None,
    config_file: str | None,
    state_dir: str | None,
    log_level: str | None,
    processes: int,
    **flags: Any,
) -> None:
    """Run an engine node (Ctrl-C drains, a second Ctrl-C stops).

    Precedence, lowest first: seed defaults, --dev, the -f file, IRONFLOW_*
    variables, flags. Leases, sessions and stale-claim thresholds must be at
    least 2x the heartbeat interval. --processes N runs N node processes on
    one port (SO_REUSEPORT), each its own node (docs/operations.md).
    """
    require_server("ironflow serve")
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
                "chaos": chaos,
            },
            timing_overrides={k: v for k, v in flags.items() if k in Timings.__struct_fields__},
            limit_overrides={k: v for k, v in flags.items() if k in Limits.__struct_fields__},
        )
    except ConfigError as exc:
        usage_failure(str(exc))
    if processes > 1:
        _serve_group(config, processes)
    for line in _banner(config, processes):
        click.echo(line, err=True)
    try:
        serve_node(config)
    except KeyboardInterrupt:  # only before the node's signal receiver is open
        click.echo("ironflow: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
