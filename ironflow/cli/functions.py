"""``ironflow functions list|pause|resume|delete``: the functions workers
registered, their triggers and schedules (what the last tick did); pause,
resume and delete (docs/schedules.md)."""

from __future__ import annotations

import time
from typing import Any

import click

from ironflow.cli import render
from ironflow.cli.client import show
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import (
    DeleteFunctionResponse,
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


def _last_tick(record: FunctionRecord, now: float) -> str:
    """What the latest tick of its schedules did: ``12s ago`` (it started a
    run), or ``skipped 34× NO_LIVE_WORKER`` (the ticks in a row that did not)."""
    considered = [s for s in record.schedules if s.last_tick_at is not None]
    if not considered:
        return "-"
    last = max(considered, key=lambda s: s.last_tick_at or 0.0)
    if last.skip_reason is None:
        return render.ago(last.last_tick_at, now)
    return f"skipped {last.skipped_ticks}× {last.skip_reason}"


def _state(record: FunctionRecord) -> str:
    if record.deleted_at is not None:
        return "deleted"
    return "paused" if record.paused_at is not None else "active"


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
        _last_tick(record, now),
        _state(record),
        "yes" if record.live else "no",
    ]


@client_command(group, "list")
@click.option("--all", "show_all", is_flag=True, help="Also deleted functions.")
@json_option
def functions_list(client: IronflowSync, as_json: bool, show_all: bool) -> None:
    """List functions, their triggers and what their last tick did. LIVE: a
    worker serves it, or did within the node's limits.function_live_s (a
    cron function not live starts no runs: its ticks are skipped, NO_LIVE_WORKER)."""

    def print_functions(answer: FunctionList) -> None:
        now = time.time()
        render.table(
            ["FUNCTION", "TRIGGERS", "MAX ATTEMPTS", "CONCURRENCY", "VERSION", "LAST SEEN",
             "NEXT TICK", "LAST TICK", "STATE", "LIVE"],
            [_row(f, now) for f in answer.functions],
            empty="no functions registered (start a worker)",
        )

    call = calls.list_functions(include_deleted=show_all)
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


@client_command(group, "delete")
@click.argument("function_id")
@json_option
def functions_delete(client: IronflowSync, function_id: str, as_json: bool) -> None:
    """Delete a function: no new run from its events or ticks; runs in flight
    finish and its definition stays for their history. A worker registering
    it again brings it back."""

    def print_deleted(answer: DeleteFunctionResponse) -> None:
        click.echo(f"function {answer.function_id} " + ("deleted" if answer.changed else "was already deleted"))

    show(client, calls.delete_function(function_id), as_json=as_json, render_answer=print_deleted)
