"""One recovered segment counted and logged (actors/recovered.py), as the
scanner, a lost socket and a drain's deadline each need it."""

from __future__ import annotations

import logging

import pytest

from actors.recovered import note_recovered
from ironflow.engine import metrics
from ironflow.store import RecoveredSegment

log = logging.getLogger("ironflow.test.recovered")


def _seg(*, exhausted: bool) -> RecoveredSegment:
    return RecoveredSegment(
        run_id="run_1", function_id="fn-recovered", old_execution_seq=3,
        new_execution_seq=None if exhausted else 4, session_id="sess_1",
        recovery_count=2, eligible_at=None, exhausted=exhausted, duration_s=1.5,
    )


def _count(name: str, labels: dict[str, str]) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_recovered_segment_is_counted_under_its_path_and_logged_with_its_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = _count("ironflow_segments_recovered_total", {"path": "disconnect"})
    ended = _count("ironflow_runs_total", {"status": "failed"})
    with caplog.at_level(logging.WARNING, logger=log.name):
        note_recovered(log, _seg(exhausted=False), path="disconnect", message="recovered!",
                       exhausted_message="ended!", fields={"execution_seq": 4})
    assert _count("ironflow_segments_recovered_total", {"path": "disconnect"}) == before + 1
    assert _count("ironflow_runs_total", {"status": "failed"}) == ended  # the run goes on
    [record] = caplog.records
    assert record.getMessage() == "recovered!"
    assert record.fields == {"run_id": "run_1", "execution_seq": 4}  # type: ignore[attr-defined]


def test_a_run_the_ceiling_ended_is_counted_as_failed_once_with_its_own_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ended = _count("ironflow_runs_total", {"status": "failed"})
    with caplog.at_level(logging.WARNING, logger=log.name):
        note_recovered(log, _seg(exhausted=True), path="lease_expiry", message="recovered!",
                       fields={"execution_seq": 4}, exhausted_message="ended!",
                       exhausted_fields={"code": "EXECUTION_RECOVERY_EXHAUSTED"})
        # A path without a line of its own for it logs its one line.
        note_recovered(log, _seg(exhausted=True), path="drain_deadline", message="drained!",
                       fields={"mode": "pull"})
    assert _count("ironflow_runs_total", {"status": "failed"}) == ended + 2
    assert [(r.getMessage(), r.fields) for r in caplog.records] == [  # type: ignore[attr-defined]
        ("ended!", {"run_id": "run_1", "code": "EXECUTION_RECOVERY_EXHAUSTED"}),
        ("drained!", {"run_id": "run_1", "mode": "pull"}),
    ]
