"""The dispatcher in virtual time: kicked for new work, and awake exactly when a countdown ends."""

from __future__ import annotations

import trio
import trio.testing

from actors import capacity_scanner, dispatcher
from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick, kick
from ironflow.config import NodeConfig, Timings
from ironflow.protocol import EngineMessage, FunctionDef, JobAssignment, Trigger
from ironflow.store import Fence, Store
from tests.unit.virtual_time import BASE

FN = FunctionDef(id="fn", triggers=[Trigger("go")])


async def start_dispatcher(
    store: Store, nursery: trio.Nursery, kicks: trio.MemoryReceiveChannel[Kick]
) -> trio.MemoryReceiveChannel[EngineMessage]:
    """A 4-slot session for ``fn`` and a dispatcher (1000 s idle re-check) serving
    it; the session's outbox."""
    cfg = NodeConfig(timings=Timings(dispatch_idle_poll_s=1000.0))
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=4, functions=[FN], session_expiry_s=90
    )
    directory = SessionDirectory()
    outbox_send, outbox = trio.open_memory_channel[EngineMessage](10)
    directory.add(LocalSession(info.session_id, frozenset({"fn"}), outbox_send))
    await nursery.start(dispatcher.run, store, cfg, "n1", directory, kicks)
    return outbox




async def test_new_work_is_dispatched_on_a_kick_not_a_timer(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    kick_send, kick_receive = trio.open_memory_channel[Kick](10)
    outbox = await start_dispatcher(store, nursery, kick_receive)
    await trio.sleep(5)  # the dispatcher is asleep on its 1000 s idle re-check
    t0 = trio.current_time()
    run_id = (await store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
    kick(kick_send, "event ingested")
    assignment = await outbox.receive()
    assert isinstance(assignment, JobAssignment) and assignment.run_id == run_id
    assert trio.current_time() - t0 < 0.01


async def test_recovered_segment_is_dispatched_when_its_grace_ends(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = NodeConfig(timings=Timings(dispatch_idle_poll_s=1000.0, scanner_interval_s=30.0))
    t = cfg.timings
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1, functions=[FN],
        session_expiry_s=10_000,
    )
    run_id = (await store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
    (res,) = await store.reserve_segments("n1", {info.session_id: frozenset({"fn"})}, 1, reservation_expiry_s=30)
    a = res.assignment
    await store.activate_lease(Fence(info.session_id, a.run_id, a.execution_seq, a.lease_token), lease_expiry_s=90)

    directory = SessionDirectory()
    outbox_send, outbox = trio.open_memory_channel[EngineMessage](10)
    directory.add(LocalSession(info.session_id, frozenset({"fn"}), outbox_send))
    kick_send, kick_receive = trio.open_memory_channel[Kick](10)
    await nursery.start(capacity_scanner.run, store, cfg, kick_send)
    await nursery.start(dispatcher.run, store, cfg, "n1", directory, kick_receive)
    assignment = await outbox.receive()
    detail = await store.get_run(run_id)
    assert isinstance(assignment, JobAssignment) and assignment.execution_seq == a.execution_seq + 1
    audit = await store.list_audit(run_id=run_id, type="capacity.segment.recovered")
    recovered_at = audit[0].at
    # Handed out when the 30 s grace ended: no scan or dispatch tick added.
    now = BASE + trio.current_time()
    assert recovered_at + t.recovery_grace_s <= now < recovered_at + t.recovery_grace_s + 0.02
    assert detail.run.recovery_count == 1


class _CountingStore:
    """The store, counting how often the dispatcher asks when to wake; a kick
    is sent from inside every reservation round (a producer racing the round)."""

    def __init__(self, store: Store, kicks: trio.MemorySendChannel[Kick]) -> None:
        self._store = store
        self._kicks = kicks
        self.wake_queries = 0
        self.rounds = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def reserve_segments(self, *args: object, **kwargs: object) -> object:
        self.rounds += 1
        if self.rounds <= 3:
            kick(self._kicks, "racing the round")
        return await self._store.reserve_segments(*args, **kwargs)  # type: ignore[arg-type]

    async def seconds_until_next_eligible(self) -> float | None:
        self.wake_queries += 1
        return await self._store.seconds_until_next_eligible()


async def test_a_kick_during_a_round_starts_the_next_round_without_asking_when_to_wake(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    kick_send, kick_receive = trio.open_memory_channel[Kick](10)
    counting = _CountingStore(store, kick_send)
    await start_dispatcher(counting, nursery, kick_receive)  # type: ignore[arg-type]
    await trio.sleep(5)
    # Rounds 1-3 each saw a kick arrive while they ran; round 4 saw none.
    assert counting.rounds == 4 and counting.wake_queries == 1
