"""A reservation transaction that runs the queue dry also reads when the next
row becomes eligible, so the dispatcher going idle asks no more (both backends)."""

from __future__ import annotations

import pytest

from ironflow.protocol import ErrorInfo
from ironflow.store import Reservations
from tests.store.behaviour import emit, reserve, running, worker


async def test_a_reservation_that_runs_the_queue_dry_says_when_the_next_row_is_due(store):
    s = await worker(store, slots=3)
    idle = await reserve(store, s)
    assert isinstance(idle, Reservations) and idle.next_eligible_known and idle.next_eligible is None
    failed = await running(store, s)
    await store.fail_job(failed, ErrorInfo("boom"))  # its retry is due in about a second
    await emit(store)
    await emit(store)
    full = await reserve(store, s, limit=1)
    assert len(full) == 1 and not full.next_eligible_known  # a full batch: the dispatcher reserves again
    dry = await reserve(store, s, limit=5)
    assert len(dry) == 1 and dry.next_eligible_known
    assert dry.next_eligible == pytest.approx(await store.seconds_until_next_eligible(), abs=0.05)
    assert 0 < dry.next_eligible <= 1.0
