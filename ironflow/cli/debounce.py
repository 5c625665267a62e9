"""``ironflow debounce list``: pending debounces, soonest first (docs/flow-control.md)."""

from __future__ import annotations

import click

from ironflow.cli import render
from ironflow.cli.client import show
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import DebounceList
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


@click.group("debounce")
def group() -> None:
    """Debounced runs waiting for their quiet period to end."""


def print_debounces(answer: DebounceList) -> None:
    rows = [
        [d.function_id, d.key or "-", d.run_id, d.event_id, render.countdown(d.fire_in_s)]
        for d in answer.debounces
    ]
    render.table(["FUNCTION", "KEY", "RUN", "LAST EVENT", "FIRES IN"], rows, empty="no pending debounces")


@client_command(group, "list")
@click.option("--function", "function_id", default=None, help="Only debounces of this function id.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@json_option
def debounce_list(client: IronflowSync, function_id: str | None, limit: int, as_json: bool) -> None:
    """List pending debounces: each starts its run when its countdown ends."""
    show(client, calls.list_debounces(function_id=function_id, limit=limit), as_json=as_json,
         render_answer=print_debounces)
