"""The small steps the store's behavioural tests take (a function, a worker
session, an emit, a reservation, a running segment) and the timings they use.
Imported by the test modules; no tests here.
"""

from __future__ import annotations

from ironflow.protocol import (
    FunctionDef,
    Trigger,
)
from ironflow.store import (
    Fence,
    Store,
)

LEASE = 90.0
SESSION = 90.0
# A liveness window (limits.function_live_s) where liveness is not the point.
ALWAYS_LIVE = 10.0**9
RESERVATION = 30.0
GRACE = 30.0


def fn(fid: str = "f", *triggers: str, **kw) -> FunctionDef:
    return FunctionDef(
        id=fid, triggers=[Trigger(t) for t in (triggers or ("order.created",))], **kw
    )


async def worker(store: Store, *functions: FunctionDef, slots: int = 2, node: str = "n1"):
    return await store.register_worker(
        node_id=node,
        worker_id="w1",
        mode="stream",
        max_concurrent_jobs=slots,
        functions=list(functions or (fn(),)),
        session_expiry_s=SESSION,
    )


async def reserve(store: Store, session, limit: int = 10, node: str = "n1"):
    return await store.reserve_segments(
        node,
        {session.session_id: frozenset(session.function_ids)},
        limit,
        reservation_expiry_s=RESERVATION,
    )


def fence_of(res) -> Fence:
    a = res.assignment
    return Fence(res.session_id, a.run_id, a.execution_seq, a.lease_token)


async def emit(store: Store, name: str = "order.created", data=None, key=None):
    return await store.ingest_event(name, data or {}, key, idempotency_window_s=3600)


async def running(store: Store, session=None, **kw) -> Fence:
    """Emit one event and take its run to 'running'; returns the live fence."""
    session = session or await worker(store)
    await emit(store, **kw)
    (res,) = await reserve(store, session, limit=1)
    f = fence_of(res)
    await store.activate_lease(f, lease_expiry_s=LEASE)
    return f
