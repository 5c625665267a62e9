"""The dispatcher in virtual time: kicked for new work, and awake exactly when a countdown ends."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actors import capacity_scanner, dispatcher, waker
from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick, kick
from ironflow.config import NodeConfig, Timings
from ironflow.engine import metrics
from ironflow.protocol import EngineMessage, FunctionDef, JobAssignment, SleepYield, Trigger
from ironflow.store import Fence, RecoveredSegment, Store
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
    # Rounds 1-3 each saw a kick arrive while they ran; round 4 saw none, and
    # its reservation transaction already said when to wake (nothing due).
    assert counting.rounds == 4 and counting.wake_queries == 0



class _ShieldedRounds(_CountingStore):
    """Like a threaded store: every round waits shielded (no cancel lands in
    it), reserves nothing and is kicked again, for ``kicked_rounds`` rounds."""

    def __init__(self, store: Store, kicks: trio.MemorySendChannel[Kick], kicked_rounds: int) -> None:
        super().__init__(store, kicks)
        self.kicked_rounds = kicked_rounds

    async def reserve_segments(self, *args: object, **kwargs: object) -> object:
        self.rounds += 1
        if self.rounds <= self.kicked_rounds:
            kick(self._kicks, "racing the round")
        with trio.CancelScope(shield=True):
            await trio.sleep(0.001)
        return []


async def test_a_dispatcher_kicked_round_after_round_still_stops_when_cancelled(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    kick_send, kick_receive = trio.open_memory_channel[Kick](10)
    shielded = _ShieldedRounds(store, kick_send, kicked_rounds=1000)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await start_dispatcher(shielded, nursery, kick_receive)  # type: ignore[arg-type]
            await trio.sleep(0.05)  # some rounds in, kicks still coming
            at_cancel = shielded.rounds
            scope.cancel()
    assert 0 < at_cancel < 1000
    assert shielded.rounds <= at_cancel + 1  # it stopped within the round it was in


# ── sleeps woken ahead of their time (waker_lookahead): held until the wake time ──

WAKE = 10.0  # the sleep's wake time, virtual seconds
LOOKAHEAD = 1.0
# A start computed from a whole-ms delay: up to 1 ms past the wake time, never before.
MS = 0.001 + 1e-9


class Harness:
    """A store with one run parked on a sleep due at ``WAKE``, the waker (with
    look-ahead), the scanner and the dispatcher running, and worker sessions
    added on demand, each with its own outbox."""

    def __init__(self, store: Store, nursery: trio.Nursery) -> None:
        self.store, self.nursery = store, nursery
        self.directory = SessionDirectory()
        self.kick_send, self.kick_receive = trio.open_memory_channel[Kick](100)
        self.cfg = NodeConfig(timings=Timings(
            dispatch_idle_poll_s=1000.0, waker_interval_s=1000.0, waker_lookahead_s=LOOKAHEAD,
        ))
        self.run_id = ""

    async def start(self, *, park_until: float = WAKE) -> None:
        parker = await self.store.register_worker(
            node_id="n1", worker_id="parker", mode="stream", max_concurrent_jobs=1, functions=[FN],
            session_expiry_s=10**6,
        )
        self.run_id = (await self.store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
        (res,) = await self.store.reserve_segments(
            "n1", {parker.session_id: frozenset({"fn"})}, 1, reservation_expiry_s=10**6
        )
        a = res.assignment
        fence = Fence(parker.session_id, a.run_id, a.execution_seq, a.lease_token)
        await self.store.activate_lease(fence, lease_expiry_s=10**6)
        await self.store.yield_job(fence, step_id="nap", name="nap", info=SleepYield(until=BASE + park_until))
        await self.store.close_session(parker.session_id, recover_leases=False, recovery_grace_s=0,
                                       recovery_ceiling=10)
        await self.nursery.start(waker.run, self.store, self.cfg, "n1", self.kick_send)
        await self.nursery.start(dispatcher.run, self.store, self.cfg, "n1", self.directory, self.kick_receive)

    async def session(self, *, delayed_start: bool) -> tuple[str, trio.MemoryReceiveChannel[EngineMessage]]:
        info = await self.store.register_worker(
            node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1, functions=[FN],
            session_expiry_s=10**6,
        )
        send, receive = trio.open_memory_channel[EngineMessage](10)
        self.directory.add(LocalSession(info.session_id, frozenset({"fn"}), send, delayed_start=delayed_start))
        kick(self.kick_send, "session opened")
        return info.session_id, receive

    async def lose(self, session_id: str) -> list[RecoveredSegment]:
        """The session's worker died (kill -9: its socket closed): its leases recovered."""
        self.directory.remove(session_id)
        return await self.store.close_session(
            session_id, recover_leases=True, recovery_grace_s=30, recovery_ceiling=10
        )


async def next_job(outbox: trio.MemoryReceiveChannel[EngineMessage]) -> JobAssignment:
    with trio.fail_after(100):
        msg = await outbox.receive()
    assert isinstance(msg, JobAssignment)
    return msg


def starts_at(job: JobAssignment) -> float:
    """When a worker that received ``job`` now may start its handler (virtual time)."""
    return trio.current_time() + job.start_delay_ms / 1000


def fence(session_id: str, job: JobAssignment) -> Fence:
    return Fence(session_id, job.run_id, job.execution_seq, job.lease_token)


async def test_a_sleep_woken_ahead_goes_at_once_to_a_worker_that_holds_it_with_the_delay_to_its_wake_time(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, nursery)
    _, outbox = await h.session(delayed_start=True)
    await h.start()
    job = await next_job(outbox)
    assert WAKE - LOOKAHEAD <= trio.current_time() < WAKE - LOOKAHEAD + 0.01  # delivered ahead
    assert WAKE <= starts_at(job) <= WAKE + MS  # to start at the wake time, never before
    assert [m.step_id for m in job.completed_steps] == ["nap"]
    # The dispatcher learnt the database clock from the reservation (the
    # socket writer re-stamps held jobs with it: actors.directory.fresh_start).
    assert h.directory.db_clock.sampled


async def test_a_worker_that_cannot_hold_a_job_is_sent_it_only_at_its_start_time(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, nursery)
    _, outbox = await h.session(delayed_start=False)
    await h.start()
    await next_job(outbox)
    assert WAKE <= trio.current_time() <= WAKE + MS


async def test_a_worker_killed_during_the_hold_leaves_a_redelivery_that_still_starts_at_the_wake_time(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, nursery)
    first, outbox = await h.session(delayed_start=True)
    await h.start()
    job = await next_job(outbox)
    await trio.sleep(0.2)  # held (unacked); then the worker dies (kill -9: its socket closes)
    assert await h.lose(first) == []
    second, outbox2 = await h.session(delayed_start=True)
    again = await next_job(outbox2)
    assert again.execution_seq == job.execution_seq  # its reservation released, not fenced
    assert trio.current_time() < WAKE  # re-delivered at once, still ahead ...
    assert WAKE <= starts_at(again) <= WAKE + MS  # ... and held to the same wake time
    # Had it been acked (a lease) before the worker died: recovered under a new
    # seq, and still held to the wake time.
    await store.activate_lease(fence(second, again), lease_expiry_s=90)
    await trio.sleep(0.2)
    recovered = await h.lose(second)
    assert [r.run_id for r in recovered] == [h.run_id]
    third, outbox3 = await h.session(delayed_start=True)
    recovered_job = await next_job(outbox3)
    assert recovered_job.execution_seq == job.execution_seq + 1
    assert trio.current_time() < WAKE and WAKE <= starts_at(recovered_job) <= WAKE + MS
    # A worker that cannot hold is sent the next re-delivery (after a drain's
    # nack) only at the wake time.
    await store.nack_job(fence(third, recovered_job), "DRAINING")
    h.directory.remove(third)
    _, outbox4 = await h.session(delayed_start=False)
    await next_job(outbox4)
    assert WAKE <= trio.current_time() <= WAKE + MS


async def test_a_run_cancelled_during_the_hold_is_never_sent_to_a_worker_that_cannot_hold(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, nursery)
    _, outbox = await h.session(delayed_start=False)
    await h.start()
    await trio.sleep(WAKE - LOOKAHEAD + 0.5)  # reserved and held by the node
    assert (await store.get_run(h.run_id)).queue is not None
    out = await store.cancel_run(h.run_id, "user")
    assert out.session_id is not None  # the reservation's owner is told (the API sends Cancel)
    await trio.sleep(LOOKAHEAD)
    with pytest.raises(trio.WouldBlock):
        outbox.receive_nowait()
    assert (await store.get_run(h.run_id)).run.status == "cancelled"
    assert (await store.list_sessions())[-1].credits_claimed == 0


def _lateness() -> tuple[float, float]:
    """(observations, seconds) of ironflow_wake_lateness_seconds so far."""
    get = metrics.REGISTRY.get_sample_value
    return (get("ironflow_wake_lateness_seconds_count") or 0.0,
            get("ironflow_wake_lateness_seconds_sum") or 0.0)


async def test_wake_lateness_is_observed_when_the_woken_segment_is_handed_over_ahead_it_counts_0(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, nursery)
    first, outbox = await h.session(delayed_start=True)
    await h.start()
    count0, sum0 = _lateness()
    job = await next_job(outbox)
    count1, sum1 = _lateness()
    assert (count1 - count0, sum1 - sum0) == (1, 0.0)  # handed ahead: held, on time
    # A re-delivery (the worker died) is not another wake.
    await store.activate_lease(fence(first, job), lease_expiry_s=90)  # acked, then lost
    h.directory.remove(first)
    await store.close_session(first, recover_leases=True, recovery_grace_s=30, recovery_ceiling=10)
    _, outbox2 = await h.session(delayed_start=True)
    await next_job(outbox2)
    assert _lateness() == (count1, sum1)


async def test_wake_lateness_of_a_segment_no_worker_could_take_is_how_late_it_was_handed_over(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, nursery)
    await h.start()
    await trio.sleep(WAKE + 3.0)  # resumed ahead, but no worker until 3 s after the wake time
    count0, sum0 = _lateness()
    _, outbox = await h.session(delayed_start=True)
    job = await next_job(outbox)
    assert job.start_delay_ms == 0
    count1, sum1 = _lateness()
    assert count1 - count0 == 1 and sum1 - sum0 == pytest.approx(3.0, abs=0.01)


async def test_throttled_runs_start_on_time_while_other_runs_wait_for_a_concurrency_slot(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A queue row eligible now but held by a concurrency limit (another
    function's backlog) is no reason to sleep until a kick: the dispatcher
    still wakes when the next throttled start is due."""
    from ironflow.protocol import Concurrency, Throttle

    thr = FunctionDef(id="thr", triggers=[Trigger("thr.go")], throttle=Throttle(limit=5, period_s=1.0))
    one = FunctionDef(id="one", triggers=[Trigger("one.go")], concurrency=Concurrency(1))
    cfg = NodeConfig(timings=Timings(dispatch_idle_poll_s=1000.0))
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=10, functions=[thr, one],
        session_expiry_s=10_000,
    )
    for _ in range(2):  # the first takes the slot and keeps it; the second waits
        await store.ingest_event("one.go", {}, None, idempotency_window_s=60)
    for n in range(4):
        await store.ingest_event("thr.go", {"n": n}, None, idempotency_window_s=60)
    directory = SessionDirectory()
    outbox_send, outbox = trio.open_memory_channel[EngineMessage](10)
    directory.add(LocalSession(info.session_id, frozenset({"thr", "one"}), outbox_send))
    kick_send, kick_receive = trio.open_memory_channel[Kick](10)
    t0 = trio.current_time()
    await nursery.start(dispatcher.run, store, cfg, "n1", directory, kick_receive)
    starts = []
    while len(starts) < 4:
        assignment = await outbox.receive()
        assert isinstance(assignment, JobAssignment)
        if assignment.function_id == "thr":
            starts.append(round(trio.current_time() - t0, 3))
    assert starts == [0.0, 0.2, 0.4, 0.6]
