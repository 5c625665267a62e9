"""``ironflow runs``: list, inspect, cancel, resume, pause and purge runs."""

from __future__ import annotations

import time
from typing import Any, cast

import click

from ironflow.cli import render
from ironflow.cli.client import send, show
from ironflow.cli.errors import CliFailure
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import (
    CancelResponse,
    ErrorInfo,
    FinishedRunStatus,
    PurgeResponse,
    RunDetail,
    RunList,
    RunResult,
    StepRecord,
    encoder,
)
from ironflow.protocol.run_control import MAX_BULK_RESUME, ResumeResponse, RunPauseResponse
from ironflow.sdk import calls
from ironflow.sdk.calls import Answer
from ironflow.sdk.client import IronflowSync

# A run's output gets more room than a table cell: it is the one thing shown.
OUTPUT_MAX = 400
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


@click.group("runs")
def group() -> None:
    """List, inspect, cancel, resume and pause runs."""


def print_runs(answer: RunList) -> None:
    now = time.time()
    rows = [
        [
            r.id,
            r.function_id,
            r.status,
            f"{r.attempt}/{r.max_attempts}",
            r.recovery_count,
            r.current_execution_seq,
            render.ago(r.created_at, now),
            render.duration_ms(r.started_at, r.ended_at),
        ]
        for r in answer.runs
    ]
    render.table(
        ["RUN", "FUNCTION", "STATUS", "ATTEMPT", "RECOVERIES", "SEQ", "CREATED", "DURATION"],
        rows,
        empty="no runs",
    )
    render.next_page(answer.next_cursor, "ironflow runs list")


@client_command(group, "list")
@click.option(
    "--status", default=None, help="waiting_for_capacity|running|waiting|paused|completed|failed|cancelled"
)
@click.option("--function", "function_id", default=None, help="Only runs of this function id.")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--cursor", default=None, help="The page after this one (printed under the page before).")
@json_option
def runs_list(
    client: IronflowSync, status: str | None, function_id: str | None, limit: int, cursor: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, one page."""
    call = calls.list_runs(status=status, function=function_id, limit=limit, cursor=cursor)
    show(client, call, as_json=as_json, render_answer=print_runs)


def _error_text(error: ErrorInfo) -> str:
    return f"{error.code}: {error.message}"


def _where_it_is(detail: RunDetail) -> list[tuple[str, Any]]:
    """Why the run waits, its queue entry and its lease, as far as it has them."""
    pairs: list[tuple[str, Any]] = []
    if detail.waiting_reason:
        pairs.append(("waiting", detail.waiting_reason))
    if (queue := detail.queue) is not None:
        owner = queue.reservation_owner
        reserved = f", reserved by session {owner}" if owner else ""
        eligible = render.countdown(queue.eligible_in_s)
        pairs.append(
            ("queued", f"seq {queue.execution_seq} ({queue.reason}), eligible {eligible}{reserved}")
        )
    if (lease := detail.lease) is not None:
        expires = render.countdown(lease.expires_in_s, past="now (expired)")
        pairs.append(
            (
                "lease",
                f"seq {lease.execution_seq} on session {lease.session_id} "
                f"(node {lease.node_id}), expires {expires}",
            )
        )
    return pairs


def _run_fields(detail: RunDetail, now: float) -> list[tuple[str, Any]]:
    run = detail.run
    pairs: list[tuple[str, Any]] = [
        ("run", run.id),
        ("function", run.function_id),
        ("status", run.status),
        ("attempt", f"{run.attempt}/{run.max_attempts}"),
        ("recovery_count", run.recovery_count),
        ("execution_seq", run.current_execution_seq),
        ("event", run.event_id),
    ]
    if run.parent_run_id:
        pairs.append(("parent run", run.parent_run_id))
    if run.concurrency_key:
        pairs.append(("concurrency key", run.concurrency_key))
    pairs += [
        ("created", render.ago(run.created_at, now)),
        ("started", render.ago(run.started_at, now)),
        ("ended", render.ago(run.ended_at, now)),
        ("duration", render.duration_ms(run.started_at, run.ended_at)),
    ]
    pairs += _where_it_is(detail)
    if run.output is not None:
        pairs.append(("output", render.compact(run.output, OUTPUT_MAX)))
    if run.error is not None:
        pairs.append(("error", _error_text(run.error)))
    return pairs


def _step_row(step: StepRecord, now: float) -> list[Any]:
    shown = step.output
    if step.error is not None:
        shown = _error_text(step.error)
    elif step.status == "sleeping" and step.wake_at:
        shown = f"wakes {render.ago(step.wake_at, now)}"
    return [
        step.step_id,
        step.name,
        step.kind,
        step.status,
        render.ms(step.duration_ms),
        render.compact(shown),
    ]


def print_run_detail(detail: RunDetail) -> None:
    """The run's fields, its traceback if it failed, then its steps as a table."""
    now = detail.db_now or time.time()
    render.fields(_run_fields(detail, now))
    error = detail.run.error
    if error is not None and error.traceback:
        click.echo("traceback:")
        for line in error.traceback.rstrip().splitlines():
            click.echo(f"  {line}")
    click.echo("")
    rows = [_step_row(step, now) for step in detail.steps]
    render.table(
        ["STEP ID", "NAME", "KIND", "STATUS", "DURATION", "OUTPUT"], rows, empty="no steps yet"
    )


@client_command(group, "get")
@click.argument("run_id")
@json_option
def runs_get(client: IronflowSync, run_id: str, as_json: bool) -> None:
    """Show one run: counters, output or error, why it waits, and its steps."""
    show(client, calls.get_run(run_id), as_json=as_json, render_answer=print_run_detail)


@client_command(group, "cancel")
@click.argument("run_id")
@click.option("--reason", default=None, help="Recorded with the cancellation.")
@json_option
def runs_cancel(client: IronflowSync, run_id: str, reason: str | None, as_json: bool) -> None:
    """Cancel a run that has not ended."""

    def print_cancelled(answer: CancelResponse) -> None:
        if answer.compensating:
            click.echo(f"run {answer.run_id} cancelled: its undos run now, then it ends cancelled")
        else:
            click.echo(f"run {answer.run_id} {answer.status}")

    show(client, calls.cancel_run(run_id, reason), as_json=as_json, render_answer=print_cancelled)


def wait_for_result(client: IronflowSync, run_id: str, timeout: float | None) -> Answer[RunResult]:
    """The run's outcome once it ends (the node holds each request open), or its
    status when ``timeout`` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait_s = calls.RESULT_WAIT_MAX_S if deadline is None else max(0.0, deadline - time.monotonic())
        answer = send(client, calls.run_result(run_id, wait_s))
        if answer.value.ended or (deadline is not None and time.monotonic() >= deadline):
            return answer


def print_result(outcome: RunResult) -> None:
    """The output of a completed run as JSON; a run that did not complete is a failure."""
    if not outcome.ended:
        raise CliFailure(f"run {outcome.run_id} is still {outcome.status}")
    if outcome.status != "completed":
        error = outcome.error
        detail = f"{error.code}: {error.message}" if error else outcome.status
        raise CliFailure(f"run {outcome.run_id} {outcome.status}: {detail}")
    render.echo_json(encoder.encode(outcome.output))


@client_command(group, "wait")
@click.argument("run_id")
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds (exit 1).")
@json_option
def runs_wait(client: IronflowSync, run_id: str, timeout: float | None, as_json: bool) -> None:
    """Wait for a run to end and print its output (exit 1 if it failed or is still going)."""
    answer = wait_for_result(client, run_id, timeout)
    if as_json:
        render.echo_json(answer.content)
    else:
        print_result(answer.value)


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


@client_command(group, "purge")
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
@json_option
def runs_purge(
    client: IronflowSync, older_than_s: float, statuses: tuple[str, ...], as_json: bool
) -> None:
    """Delete finished runs now, with their steps and audit rows (platform key).

    Events go too once past the idempotency window and no kept run needs them.
    Runs that have not ended, and children of kept runs, always stay.
    """
    finished = cast("list[FinishedRunStatus]", list(statuses))  # click.Choice checked them

    def print_purged(purged: PurgeResponse) -> None:
        click.echo(
            f"purged {purged.runs} runs, {purged.steps} steps, {purged.audit} audit rows"
            f" and {purged.events} events (ended more than {render.span(older_than_s)} ago)"
        )

    call = calls.purge_runs(older_than_s, finished)
    show(client, call, as_json=as_json, render_answer=print_purged)


# ── run control (docs/run-control.md) ──


def print_resumed(answer: ResumeResponse) -> None:
    again = f" from step {answer.from_step!r} ({answer.steps_deleted} step rows to run again)"
    parked = "; waiting on its parked step (a sleep or wait not over yet)"
    click.echo(
        f"run {answer.run_id} resumed (was {answer.resumed_from})"
        + (again if answer.from_step else "")
        + (parked if answer.status == "waiting" else "")
    )


@client_command(group, "resume")
@click.argument("run_id", required=False)
@click.option("--from-step", default=None, help="Run again from this step (name or id) on.")
@click.option("--function", "function_id", default=None, help="Bulk: only runs of this function.")
@click.option(
    "--status", type=click.Choice(["failed"]), default=None, help="Bulk: the runs to resume (failed)."
)
@click.option(
    "--since", "since_s", type=Duration(), default=None,
    help="Bulk: runs that failed within this long (90s, 15m, 1h, 3d).",
)
@click.option("--limit", type=click.IntRange(1, MAX_BULK_RESUME), default=100, help="Bulk: runs per request.")
@json_option
def runs_resume(
    client: IronflowSync, run_id: str | None, from_step: str | None, function_id: str | None,
    status: str | None, since_s: float | None, limit: int, as_json: bool,
) -> None:
    """Resume a failed run from its failed step (or --from-step), or a paused run.

    Bulk, without RUN_ID: every run that failed within --since (of --function),
    page by page.
    """
    if run_id is not None:
        if function_id or status or since_s is not None:
            raise CliFailure("give a RUN_ID or --since/--function/--status, not both")
        show(client, calls.resume_run(run_id, from_step), as_json=as_json, render_answer=print_resumed)
        return
    if since_s is None:
        raise CliFailure("give a RUN_ID, or --since (with --status failed) to resume in bulk")
    if from_step is not None:
        raise CliFailure("--from-step needs a RUN_ID")
    cursor: str | None = None
    total = 0
    while True:
        answer = send(client, calls.resume_runs(since_s, function_id=function_id, limit=limit, cursor=cursor))
        for resumed in answer.value.resumed:
            if as_json:
                render.echo_json(encoder.encode(resumed))
            else:
                print_resumed(resumed)
        total += len(answer.value.resumed)
        cursor = answer.value.next_cursor
        if cursor is None:
            break
    if not as_json:
        click.echo(f"resumed {total} runs")


@client_command(group, "pause")
@click.argument("run_id")
@json_option
def runs_pause(client: IronflowSync, run_id: str, as_json: bool) -> None:
    """Pause a run: off the queue; a running one stops at its next step boundary."""

    def print_paused(answer: RunPauseResponse) -> None:
        click.echo(f"run {answer.run_id} {answer.status}")

    show(client, calls.pause_run(run_id), as_json=as_json, render_answer=print_paused)
