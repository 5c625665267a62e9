"""The API's grouped emits (ironflow/api/state.py): a group whose store call
fails is retried event by event only when nothing of it can have committed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from ironflow.api.state import ApiState
from ironflow.config import Limits
from ironflow.store import CommitOutcomeUnknown, IngestResult


class FailingStore:
    """``ingest_events`` of a whole group fails with ``error``; each retry of one
    event alone is recorded (and succeeds)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.one_by_one: list[str] = []

    def on_runs_ended(self, listener: Any) -> None:
        pass

    def on_run_results(self, listener: Any) -> None:
        pass

    async def ingest_events(self, events: list[Any], *, idempotency_window_s: float) -> list[IngestResult]:
        await trio.lowlevel.checkpoint()
        if len(events) > 1:
            raise self.error
        self.one_by_one.append(events[0][0])
        return [IngestResult(f"evt_{events[0][0]}", [], False)]

    async def ingest_event(self, name: str, data: Any, key: Any, *, idempotency_window_s: float) -> IngestResult:
        return (await self.ingest_events([(name, data, key)], idempotency_window_s=idempotency_window_s))[0]


def api_state(store: FailingStore) -> ApiState:
    deps: Any = SimpleNamespace(
        store=store, config=SimpleNamespace(idempotency_window_s=60.0, limits=Limits()),
        directory=SimpleNamespace(holding_offers=dict),
    )
    return ApiState(deps)


async def test_a_group_that_failed_before_committing_is_retried_event_by_event() -> None:
    store = FailingStore(ValueError("one event's data broke the statement"))
    results = await api_state(store)._ingest_group([("a", 1, None), ("b", 2, None)])
    assert store.one_by_one == ["a", "b"]
    assert [r.unwrap().event_id for r in results] == ["evt_a", "evt_b"]


async def test_a_group_whose_commit_outcome_is_unknown_is_not_written_again() -> None:
    store = FailingStore(CommitOutcomeUnknown("connection lost during COMMIT"))
    with pytest.raises(CommitOutcomeUnknown):
        await api_state(store)._ingest_group([("a", 1, None), ("b", 2, None)])
    assert store.one_by_one == []  # each event may already be stored: not a second time
