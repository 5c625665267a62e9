"""``ironflow emit NAME``: send one event and show the runs it started."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ironflow.cli import render
from ironflow.cli.client import send, show
from ironflow.cli.errors import usage_failure
from ironflow.cli.options import client_command, json_option
from ironflow.cli.runs import print_result, wait_for_result
from ironflow.protocol import EmitResponse
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


def load_data(data: str | None, data_file: str | None) -> Any:
    """The event data from ``--data`` or ``--data-file`` (``-`` is stdin); ``{}`` if neither.

    Both given, an unreadable file or text that is not JSON is a usage failure
    (exit code 2), before the engine is asked anything.
    """
    if data is not None and data_file is not None:
        usage_failure("give either --data or --data-file, not both")
    if data_file is not None:
        try:
            text = sys.stdin.read() if data_file == "-" else Path(data_file).read_text()
        except OSError as exc:
            usage_failure(f"cannot read --data-file {data_file}: {exc.strerror or exc}")
        source = f"--data-file {data_file}"
    elif data is not None:
        text, source = data, "--data"
    else:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        usage_failure(f"{source} is not valid JSON: {exc}")


def print_emitted(answer: EmitResponse) -> None:
    duplicate = "  (duplicate: nothing new created)" if answer.duplicate else ""
    click.echo(f"event  {answer.event_id}{duplicate}")
    for run_id in answer.run_ids:
        click.echo(f"run    {run_id}")
    if not answer.run_ids:
        click.echo("runs   none (no registered function is triggered by this event)")


@client_command(None, "emit")
@click.argument("name")
@click.option("--data", default=None, help="Event data as JSON (default {}).")
@click.option(
    "--data-file", default=None, help="Read the event data (JSON) from a file, '-' for stdin."
)
@click.option("--idempotency-key", default=None, help="A repeat within the window creates nothing.")
@click.option("--wait", "wait", is_flag=True, help="Wait for the runs it started and print their output.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@json_option
def emit(
    client: IronflowSync,
    name: str,
    data: str | None,
    data_file: str | None,
    idempotency_key: str | None,
    wait: bool,
    timeout: float | None,
    as_json: bool,
) -> None:
    """Emit event NAME; print its id and the runs it started (with --wait, their output)."""
    call = calls.emit(name, load_data(data, data_file), idempotency_key)
    if not wait:
        show(client, call, as_json=as_json, render_answer=print_emitted)
        return
    answer = send(client, call).value
    if not as_json:
        print_emitted(answer)
    for run_id in answer.run_ids:
        outcome = wait_for_result(client, run_id, timeout)
        if as_json:
            render.echo_json(outcome.content)
        else:
            print_result(outcome.value)
