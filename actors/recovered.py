"""A recovered segment counted and logged: one function for every path that
fences a lease and re-enqueues its segment (the capacity scanner's lease
expiry, a streaming worker's lost socket, a drain's deadline).

Each path's log line keeps its own words (the seed quotes some verbatim);
what they share is here: the recovery counted under its path, and a run the
recovery ceiling ended counted as ended once (the store's guarded UPDATE ended
it once), then one WARNING line, the exhausted run's own line where the path
has one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from ironflow import logs
from ironflow.engine import metrics
from ironflow.store import RecoveredSegment

Path = Literal["lease_expiry", "disconnect", "drain_deadline"]


def note_recovered(
    log: logging.Logger,
    seg: RecoveredSegment,
    *,
    path: Path,
    message: str,
    fields: Mapping[str, Any],
    exhausted_message: str | None = None,
    exhausted_fields: Mapping[str, Any] | None = None,
) -> None:
    """Count ``seg``'s recovery under ``path`` (``ironflow_segments_recovered_total``),
    and its run's end when the recovery ceiling failed it (``run_ended``), then log.

    Args:
      log: the actor's logger.
      seg: what the store's recovery returned for one lease.
      path: the label the metric counts it under.
      message, fields: the WARNING line of a recovered segment (``run_id`` first).
      exhausted_message, exhausted_fields: the line instead when the run failed
        at the recovery ceiling (default: ``message`` and ``fields``).
    """
    metrics.RECOVERIES.labels(path=path).inc()
    if seg.exhausted:
        metrics.run_ended("failed", seg.function_id, seg.duration_s)
        message = exhausted_message or message
        fields = fields if exhausted_fields is None else exhausted_fields
    logs.event(log, logging.WARNING, message, run_id=seg.run_id, **fields)
