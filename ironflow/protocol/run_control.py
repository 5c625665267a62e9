"""HTTP bodies of run control (docs/run-control.md): ``POST /v1/runs/{id}/resume``,
``POST /v1/runs/resume`` (bulk), ``POST /v1/runs/{id}/pause``. The store side:
``ironflow/store/run_control.py``; the guide: ``docs/run-control.md``."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from ironflow.protocol.bounds import MAX_DURATION_S, ShortText
from ironflow.protocol.worker import RunStatus

# Most runs one bulk resume call puts back (the store's MAX_BULK_RESUME).
MAX_BULK_RESUME = 500


class ResumeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/runs/{id}/resume``: the step to run again from (its
    name or step id); None: a failed run's failed step."""

    from_step: ShortText | None = None


class ResumeResponse(msgspec.Struct, frozen=True):
    run_id: str
    function_id: str
    # The segment now queued (status 'waiting': the run's execution_seq, its
    # next segment queued when its parked step settles).
    execution_seq: int
    # What the run was: 'failed' or 'paused'.
    resumed_from: str
    # The first step that runs again (None: no step row was deleted).
    from_step: str | None = None
    steps_deleted: int = 0
    # 'waiting_for_capacity': queued; 'waiting': back on a step still parked (a
    # sleep not ended, a wait not answered), resumed when it settles.
    status: RunStatus = "waiting_for_capacity"


class BulkResumeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/runs/resume``: resume the runs that failed in the last
    ``since_s`` seconds (of ``function_id``, or of every function), oldest
    first, at most ``limit`` a call; ask again with ``cursor`` for the next page."""

    since_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)]
    function_id: ShortText | None = None
    limit: Annotated[int, Meta(ge=1, le=MAX_BULK_RESUME)] = 100
    cursor: Annotated[str, Meta(max_length=200)] | None = None


class BulkResumeResponse(msgspec.Struct, frozen=True):
    resumed: list[ResumeResponse]
    # Pass back to read the next page; None when this was the last one.
    next_cursor: str | None = None


class RunPauseResponse(msgspec.Struct, frozen=True):
    run_id: str
    status: RunStatus = "paused"
