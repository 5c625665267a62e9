"""``ironflow audit list``: the audit log, newest first."""

from __future__ import annotations

import time

import click

from ironflow.cli import render
from ironflow.cli.client import show
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import AuditList
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


@click.group("audit")
def group() -> None:
    """The audit log (recoveries are always recorded)."""


def print_audit(answer: AuditList) -> None:
    now = time.time()
    rows = [
        [render.ago(e.at, now), e.type, e.run_id, e.function_id, render.compact(e.data)]
        for e in answer.events
    ]
    render.table(["AT", "TYPE", "RUN", "FUNCTION", "DATA"], rows, empty="no audit events")
    render.next_page(answer.next_cursor, "ironflow audit list")


@client_command(group, "list")
@click.option("--run", "run_id", default=None, help="Only events of this run.")
@click.option(
    "--type", "type_", default=None, help="Only this event type, e.g. capacity.segment.recovered."
)
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--cursor", default=None, help="The page after this one (printed under the page before).")
@json_option
def audit_list(
    client: IronflowSync, run_id: str | None, type_: str | None, limit: int, cursor: str | None,
    as_json: bool,
) -> None:
    """List audit events, oldest first, one page (with their data)."""
    call = calls.list_audit(run_id=run_id, type=type_, limit=limit, cursor=cursor, include_data=True)
    show(client, call, as_json=as_json, render_answer=print_audit)
