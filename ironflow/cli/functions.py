"""``ironflow functions list|pause|resume``: the functions workers registered,
their triggers and schedules; pause and resume (docs/schedules.md)."""

from __future__ import annotations

import time
from typing import Any

import click

from ironflow.cli import render
from ironflow.cli.client import show
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import (
    FunctionList,
    FunctionRecord,
    PauseResponse,
    Trigger,
    concurrency_limits,
)
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


@click.group("functions")
def group() -> None:
    """Functions registered by workers."""


def _trigger_text(t: Trigger) -> str:
    if t.event is not None:
        return t.event
    return f"cron {t.cron!r}" + ("" if t.timezone == "UTC" else f" {t.timezone}")


def _row(record: FunctionRecord, now: float) -> list[Any]:
    definition = record.definition
    triggers = ", ".join(_trigger_text(t) for t in definition.triggers) or "-"
    next_at = min((s.next_at for s in record.schedules), default=None)
    concurrency = ", ".join(
        f"{c.limit}" + (f" per {c.key}" if c.key else "") for c in concurrency_limits(definition)
    ) or "-"
    seen = record.last_seen_at or record.updated_at
    return [
        record.id,
        triggers,
        definition.retries.max_attempts,
        concurrency,
        record.version,
        render.ago(seen, now),
        "-" if next_at is None else render.ago(next_at, now),
        "paused" if record.paused_at is not None else "active",
    ]


@client_command(group, "list")
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="Also functions no worker registered within limits.function_live_s.",
)
@json_option
def functions_list(client: IronflowSync, as_json: bool, show_all: bool) -> None:
    """List live functions (registered by a worker recently) and their triggers."""

    def print_functions(answer: FunctionList) -> None:
        now = time.time()
        rows = [
            _row(f, now) + (["yes" if f.live else "no"] if show_all else [])
            for f in answer.functions
        ]
        render.table(
            ["FUNCTION", "TRIGGERS", "MAX ATTEMPTS", "CONCURRENCY", "VERSION", "LAST REGISTERED",
             "NEXT TICK", "STATE"]
            + (["LIVE"] if show_all else []),
            rows,
            empty="no functions registered (start a worker)",
        )

    call = calls.list_functions(include_stale=show_all)
    show(client, call, as_json=as_json, render_answer=print_functions)


@client_command(group, "pause")
@click.argument("function_id")
@json_option
def functions_pause(client: IronflowSync, function_id: str, as_json: bool) -> None:
    """Pause a function: no run starts from its events or ticks (emits are
    still recorded, and say so)."""

    def print_paused(answer: PauseResponse) -> None:
        click.echo(f"function {answer.function_id} " + ("paused" if answer.changed else "was already paused"))

    show(client, calls.pause_function(function_id), as_json=as_json, render_answer=print_paused)


@client_command(group, "resume")
@click.argument("function_id")
@click.option(
    "--catchup", is_flag=True,
    help="Also start a run for the latest tick skipped while paused (none by default).",
)
@json_option
def functions_resume(client: IronflowSync, function_id: str, catchup: bool, as_json: bool) -> None:
    """Resume a paused function: its events and ticks start runs again."""

    def print_resumed(answer: PauseResponse) -> None:
        state = "resumed" if answer.changed else "was not paused"
        extra = "" if answer.catchup_run_id is None else f"; catch-up run {answer.catchup_run_id}"
        click.echo(f"function {answer.function_id} {state}{extra}")

    call = calls.resume_function(function_id, catchup=catchup)
    show(client, call, as_json=as_json, render_answer=print_resumed)
