"""The API's grouped emits: the run an emit queued goes straight to the
local worker's outbox from the emit's own transaction, and the dispatcher is kicked only for a run that was not
reserved there (ironflow/api/state.py, ``ApiState._ingest_group``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio

from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick
from ironflow.api.state import ApiState
from ironflow.config import Limits
from ironflow.protocol import Concurrency, JobAssignment
from ironflow.store import Store
from tests.store.behaviour import fn, worker


async def api_over(store: Store, *functions: Any, delayed_start: bool = True):
    session = await worker(store, *functions, slots=3)
    directory = SessionDirectory()
    outbox, assigned = trio.open_memory_channel[Any](10)
    directory.add(LocalSession(
        session.session_id, frozenset(session.function_ids), outbox, delayed_start=delayed_start,
    ))
    kicks, kicked = trio.open_memory_channel[Kick](10)
    deps: Any = SimpleNamespace(
        store=store, directory=directory, kicks=kicks,
        config=SimpleNamespace(
            idempotency_window_s=60.0, timings=SimpleNamespace(reservation_expiry_s=30.0), limits=Limits()
        ),
    )
    return ApiState(deps), assigned, kicked


def drained(channel: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(channel.receive_nowait())
        except trio.WouldBlock:
            return out


async def test_the_emits_runs_reach_the_worker_from_the_emit_and_the_dispatcher_is_not_kicked(store):
    api, assigned, kicked = await api_over(store)
    results = [r.unwrap() for r in await api._ingest_group([("order.created", {"i": 1}, None), ("order.created", {"i": 2}, None)])]
    sent = drained(assigned)
    assert all(isinstance(a, JobAssignment) for a in sent)
    assert sorted(a.run_id for a in sent) == sorted(rid for r in results for rid in r.run_ids)
    assert drained(kicked) == []


async def test_a_run_a_limit_holds_back_is_left_to_the_dispatcher(store):
    api, assigned, kicked = await api_over(store, fn("f", concurrency=Concurrency(limit=1)))
    await api._ingest_group([("order.created", {}, None), ("order.created", {}, None)])
    assert len(drained(assigned)) == 1
    assert len(drained(kicked)) == 1  # the held run: the dispatcher follows it


async def test_a_worker_that_cannot_hold_a_job_is_offered_nothing_by_the_emit(store):
    api, assigned, kicked = await api_over(store, delayed_start=False)
    await api._ingest_group([("order.created", {}, None)])
    assert drained(assigned) == [] and len(drained(kicked)) == 1
