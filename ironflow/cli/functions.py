"""``ironflow functions list``: the functions workers registered, and their triggers."""

from __future__ import annotations

import time
from typing import Any

import click

from ironflow.cli import render
from ironflow.cli.client import show
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import FunctionList, FunctionRecord, concurrency_limits
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


@click.group("functions")
def group() -> None:
    """Functions registered by workers."""


def _row(record: FunctionRecord, now: float) -> list[Any]:
    definition = record.definition
    triggers = ", ".join(t.event for t in definition.triggers) or "-"
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
            ["FUNCTION", "TRIGGERS", "MAX ATTEMPTS", "CONCURRENCY", "VERSION", "LAST REGISTERED"]
            + (["LIVE"] if show_all else []),
            rows,
            empty="no functions registered (start a worker)",
        )

    call = calls.list_functions(include_stale=show_all)
    show(client, call, as_json=as_json, render_answer=print_functions)
