"""``ironflow capacity``: leases, worker sessions and the dispatch queue (platform key)."""

from __future__ import annotations

import time

import click

from ironflow.cli import render
from ironflow.cli.client import show
from ironflow.cli.options import client_command, json_option
from ironflow.protocol import LeaseList, QueueList, SessionList
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


@click.group("capacity")
def group() -> None:
    """Leases, worker sessions and the dispatch queue (platform key only)."""


def print_leases(answer: LeaseList) -> None:
    now = time.time()
    rows = [
        [
            lease.run_id,
            lease.function_id,
            lease.execution_seq,
            lease.session_id,
            lease.node_id,
            render.ago(lease.activated_at, now),
            "expired, not yet reaped" if lease.expired else render.countdown(lease.expires_in_s, past="expired"),
        ]
        for lease in answer.leases
    ]
    render.table(
        ["RUN", "FUNCTION", "SEQ", "SESSION", "NODE", "ACTIVATED", "EXPIRES"],
        rows,
        empty="no leases",
    )


def print_sessions(answer: SessionList) -> None:
    now = time.time()
    rows = [
        [
            s.session_id,
            s.worker_id,
            s.node_id,
            s.mode,
            f"{s.credits_claimed}/{s.max_concurrent_jobs}",
            s.credits_held,
            "yes" if s.draining else "no",
            render.countdown(s.expires_at - now, past="expired"),
            render.compact(", ".join(s.function_ids) or None),
        ]
        for s in answer.sessions
    ]
    render.table(
        ["SESSION", "WORKER", "NODE", "MODE", "BUSY", "HELD", "DRAINING", "EXPIRES", "FUNCTIONS"],
        rows,
        empty="no worker sessions",
    )


def print_queue(answer: QueueList) -> None:
    now = time.time()
    rows = [
        [
            q.run_id,
            q.function_id,
            q.execution_seq,
            q.reason,
            render.countdown(q.eligible_in_s),
            q.reservation_owner,
            render.ago(q.enqueued_at, now),
        ]
        for q in answer.queue
    ]
    render.table(
        ["RUN", "FUNCTION", "SEQ", "REASON", "ELIGIBLE", "RESERVED BY", "ENQUEUED"],
        rows,
        empty="queue empty",
    )


@client_command(group, "leases")
@click.option(
    "--all", "show_all", is_flag=True,
    help="Also leases expired by database time that loop 1 has not reaped yet (marked).",
)
@json_option
def capacity_leases(client: IronflowSync, show_all: bool, as_json: bool) -> None:
    """Active concurrency leases of executing segments."""
    call = calls.list_leases(include_expired=show_all)
    show(client, call, as_json=as_json, render_answer=print_leases)


@client_command(group, "sessions")
@json_option
def capacity_sessions(client: IronflowSync, as_json: bool) -> None:
    """Connected worker sessions and their credits."""
    show(client, calls.list_sessions(), as_json=as_json, render_answer=print_sessions)


@client_command(group, "queue")
@json_option
def capacity_queue(client: IronflowSync, as_json: bool) -> None:
    """Runnable segments waiting for a worker (with their recovery-grace countdown)."""
    show(client, calls.list_queue(), as_json=as_json, render_answer=print_queue)
