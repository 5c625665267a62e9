"""One run created, with everything its creation writes: the run, its first
queue row (``transitions.enqueue``), its cancel-on subscriptions
(cancel_on.py) and its priority (dispatch_flow.py), in the caller's
transaction. An invocation, a re-run, a cron tick and a step's ``invoke``
each create one; an ingest writes many at once (``ingest.py``).
"""

from __future__ import annotations

from typing import Any

from ironflow.protocol import FunctionDef
from ironflow.store.cancel_on import subscribe_cancels
from ironflow.store.core import INVOKED_EVENT, NewRun, Tx, new_run
from ironflow.store.dispatch_flow import priority_of, set_priorities
from ironflow.store.filters import CompiledDefinitions
from ironflow.store.transitions import enqueue


def create_run(
    tx: Tx,
    definitions: CompiledDefinitions,
    fd: FunctionDef,
    event_id: str,
    data: Any,
    *,
    parent_run_id: str | None = None,
    parent_step_id: str | None = None,
    new: NewRun | None = None,
    event_name: str = INVOKED_EVENT,
) -> str:
    """Create a run of ``fd`` for event ``event_id`` (named ``event_name``:
    what a CEL key or priority reads as ``event.name``) and queue its first
    segment (``new``: the id, hold and kind an ingest chose), with its cancel-on
    subscriptions and priority; its id. ``definitions``: the store's compilations
    (its key)."""
    new = new or new_run(fd)
    run_id = new.run_id
    ckey = definitions.run_key(fd, event_name, data, event_id)
    tx.execute(
        "INSERT INTO runs (id, function_id, event_id, parent_run_id, parent_step_id, status,"
        " attempt, max_attempts, recovery_count, current_execution_seq, concurrency_key,"
        " timeout_s, batch_size, created_at, updated_at) VALUES (?, ?, ?, ?, ?,"
        " 'waiting_for_capacity', 1, ?, 0, 1, ?, ?, ?, ironflow_now(), ironflow_now())",
        (
            run_id,
            fd.id,
            event_id,
            parent_run_id,
            parent_step_id,
            max(1, fd.retries.max_attempts),
            ckey,
            fd.timeout_s,
            1 if new.batch else None,
        ),
    )
    enqueue(tx, run_id, 1, fd.id, ckey, new.delay_s, new.reason)
    subscribe_cancels(tx, [(run_id, fd, data)])
    if fd.priority is not None:  # flow control : store/flow.py
        set_priorities(tx, [(run_id, priority_of(fd, event_name, data))])
    return run_id
