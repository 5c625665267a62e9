"""The session actor, fed frames through memory channels, on a real SQLite store.

The channels stand in for the websocket: ``inbound`` carries decoded worker
frames (closed when the socket closes), ``outbox`` the engine's answers.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors import session
from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick
from ironflow.config import Limits, NodeConfig, Timings
from ironflow.protocol import (
    EngineMessage,
    FunctionDef,
    Heartbeat,
    JobAck,
    JobAssignment,
    JobCompleted,
    LeaseStatus,
    Refused,
    Register,
    Registered,
    StepCompleted,
    Trigger,
    WorkerMessage,
)
from ironflow.store import Store
from tests.unit.test_emit_hands_out import drained

FN = FunctionDef(id="fn", triggers=[Trigger("go")])
CFG = NodeConfig(timings=Timings(), limits=Limits(max_slots_per_session=8))
# How long a lone JobAck waits for its segment (Timings.ack_hold_s).
HOLD_S = CFG.timings.ack_hold_s


# The test itself must take ``autojump_clock`` too: pytest-trio only runs a
# test on the clock when the test asks for it.


def register(slots: int = 2, functions: list[FunctionDef] | None = None) -> Register:
    return Register(worker_id="w1", functions=functions or [FN], max_concurrent_jobs=slots)


class Socket:
    """One worker connection: the channel ends the session actor is given, and ours."""

    def __init__(self, store: Store, cfg: NodeConfig = CFG) -> None:
        self.store = store
        self.cfg = cfg
        self.directory = SessionDirectory()
        self.send, self.inbound = trio.open_memory_channel[WorkerMessage](100)
        self.outbox, self.received = trio.open_memory_channel[EngineMessage](100)
        self.kick_send, self.kicks = trio.open_memory_channel[Kick](100)

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        await session.run(
            self.store, self.cfg, "n1", self.directory, self.kick_send, self.inbound, self.outbox,
            task_status=task_status,
        )

    async def open(self, nursery: trio.Nursery, reg: Register | None = None) -> str:
        """Register (``reg``, or :func:`register`'s) and read Registered: the session id."""
        await self.send.send(reg or register())
        session_id: str = await nursery.start(self.serve)
        await self.answer()  # Registered
        return session_id

    async def answer(self) -> EngineMessage:
        with trio.fail_after(10):
            return await self.received.receive()

    async def until_status(self, run_id: str, status: str) -> None:
        """Wait for the store to show the run in ``status`` (frames of different
        runs are applied concurrently, so no answer orders them)."""
        with trio.fail_after(10):
            while (await self.store.get_run(run_id)).run.status != status:
                await trio.sleep(0.001)

    async def assign(self, session_id: str) -> JobAssignment:
        """Admit one new run to this session as the dispatcher would, and ack it."""
        await self.store.ingest_event("go", {}, None, idempotency_window_s=60)
        (res,) = await self.store.reserve_segments(
            "n1", {session_id: frozenset({"fn"})}, 1, reservation_expiry_s=30
        )
        a = res.assignment
        await self.send.send(JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
        return a


async def test_a_first_message_other_than_register_is_a_protocol_violation(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    sock = Socket(store)
    await sock.send.send(Heartbeat())
    with pytest.raises(session.ProtocolViolation, match="first message must be register"):
        with trio.fail_after(10):
            await sock.serve()
    assert await store.list_sessions() == [] and len(sock.directory) == 0


async def test_a_socket_closed_before_register_writes_nothing(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    sock = Socket(store)
    await sock.send.aclose()
    with trio.fail_after(10):
        await sock.serve()
    assert await store.list_sessions() == [] and await store.list_functions(live_within_s=Limits().function_live_s) == []


async def test_a_second_register_is_a_protocol_violation_and_the_session_is_closed(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    sock = Socket(store)
    await sock.send.send(register())
    await sock.send.send(register())
    with pytest.raises(session.ProtocolViolation, match="register sent twice"):
        with trio.fail_after(10):
            await sock.serve()
    answer = sock.received.receive_nowait()
    assert isinstance(answer, Registered)
    assert await store.list_sessions() == [] and len(sock.directory) == 0


async def test_a_register_past_a_limit_is_refused_and_nothing_is_written(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    for msg, refusal in [
        (register(slots=9), "max_concurrent_jobs=9 exceeds this node's limit of 8"),
        (register(functions=[FN, FN]), "function id 'fn' is registered twice"),
    ]:
        sock = Socket(store)
        await sock.send.send(msg)
        with pytest.raises(session.RegistrationRefused, match=refusal), trio.fail_after(10):
            await sock.serve()
    tight = NodeConfig(limits=Limits(max_functions_per_trigger=1))
    sock = Socket(store, tight)
    await sock.send.send(register(functions=[FN, FunctionDef(id="fn2", triggers=[Trigger("go")])]))
    with pytest.raises(session.RegistrationRefused, match="go"), trio.fail_after(10):
        await sock.serve()
    assert await store.list_sessions() == [] and await store.list_functions(live_within_s=Limits().function_live_s) == []


async def test_a_stale_fence_is_refused_for_that_job_only_and_the_connection_carries_on(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    sock = Socket(store)
    await sock.send.send(register())
    session_id = await nursery.start(sock.serve)
    registered = await sock.answer()
    t = CFG.timings
    assert registered == Registered(
        session_id,
        int(t.heartbeat_interval_s * 1000),
        int(t.lease_expiry_s * 1000),
        batch_frames=True,  # the socket's reader takes batched frames
        max_frame_bytes=CFG.max_frame_bytes,
    )
    assert sock.directory.get(session_id) is not None
    a = await sock.assign(session_id)
    b = await sock.assign(session_id)
    # A step result for `a` under a lease token that is not the live one, and
    # `b`'s final result, in one batch.
    await sock.send.send(
        StepCompleted(a.job_id, a.run_id, a.execution_seq, "forged-token-0000", "s1", "s1", 1)
    )
    await sock.send.send(JobCompleted(b.job_id, b.run_id, b.execution_seq, b.lease_token, "done"))
    await sock.until_status(b.run_id, "completed")
    refused = await sock.answer()
    assert isinstance(refused, Refused)
    assert (refused.code, refused.job_id, refused.run_id) == ("STALE_EXECUTION", a.job_id, a.run_id)
    detail_a, detail_b = await store.get_run(a.run_id), await store.get_run(b.run_id)
    assert detail_a.run.status == "running" and detail_a.steps == [] and detail_a.lease is not None
    assert detail_b.run.status == "completed" and detail_b.run.output == "done"
    # The connection carries on: `a`'s live fence still works.
    await sock.send.send(JobCompleted(a.job_id, a.run_id, a.execution_seq, a.lease_token, "also"))
    await sock.until_status(a.run_id, "completed")
    await sock.send.send(Heartbeat(jobs=[]))
    assert isinstance(await sock.answer(), LeaseStatus)


async def test_a_closed_inbound_closes_the_session_and_recovers_its_leases_at_once(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    sock = Socket(store)
    await sock.send.send(register())
    done = trio.Event()

    async def serve_then_note(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        await sock.serve(task_status=task_status)
        done.set()

    session_id = await nursery.start(serve_then_note)
    a = await sock.assign(session_id)
    await sock.until_status(a.run_id, "running")  # the ack has been applied
    assert [lease.run_id for lease in await store.list_leases()] == [a.run_id]
    t0 = trio.current_time()
    await sock.send.aclose()  # the socket dropped without a drain
    with trio.fail_after(10):
        await done.wait()
    assert trio.current_time() == t0  # at once: no lease expiry waited for
    assert await store.list_sessions() == [] and await store.list_leases() == []
    assert sock.directory.get(session_id) is None
    detail = await store.get_run(a.run_id)
    assert detail.run.recovery_count == 1
    assert detail.queue is not None and detail.queue.reason == "recovery"
    assert detail.queue.execution_seq == a.execution_seq + 1
    whys = []
    while True:
        try:
            whys.append(sock.kicks.receive_nowait().why)
        except trio.WouldBlock:
            break
    assert whys[-1] == "session closed"



class _HeldSteps:
    """The store, except that recording steps of one run (once named) waits until released."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.held_run: str | None = None
        self.entered = trio.Event()
        self.release = trio.Event()
        self.completed: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    # The session's groups reach the two methods below one run at a time.
    record_steps_many = Store.record_steps_many
    complete_jobs = Store.complete_jobs

    async def record_steps(self, fence: Any, steps: Any) -> None:
        if fence.run_id == self.held_run:
            self.entered.set()
            await self.release.wait()
        await self._store.record_steps(fence, steps)

    async def complete_job(self, fence: Any, output: Any) -> Any:
        self.completed.append(fence.run_id)
        return await self._store.complete_job(fence, output)


async def test_a_message_waiting_for_its_commit_holds_back_only_its_own_run(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    held = _HeldSteps(store)
    sock = Socket(held)  # type: ignore[arg-type]
    await sock.send.send(register())
    session_id = await nursery.start(sock.serve)
    await sock.answer()  # Registered
    a = await sock.assign(session_id)
    b = await sock.assign(session_id)
    await sock.until_status(a.run_id, "running")
    await sock.until_status(b.run_id, "running")
    held.held_run = a.run_id
    fence_a = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
    await sock.send.send(StepCompleted(*fence_a, "s1", "s1", 1))
    with trio.fail_after(10):
        await held.entered.wait()  # a's step is waiting for its commit
    # Sent after it, in later reads of the socket: a's own result, then b's.
    await sock.send.send(JobCompleted(*fence_a, "a-done"))
    await trio.sleep(1)
    await sock.send.send(JobCompleted(b.job_id, b.run_id, b.execution_seq, b.lease_token, "b-done"))
    await sock.until_status(b.run_id, "completed")  # not held back behind a's commit
    assert held.completed == [b.run_id]  # a's result waits behind a's step
    assert (await store.get_run(a.run_id)).run.status == "running"
    held.release.set()
    await sock.until_status(a.run_id, "completed")
    assert held.completed == [b.run_id, a.run_id]
    detail = await store.get_run(a.run_id)
    assert [s.step_id for s in detail.steps] == ["s1"] and detail.run.output == "a-done"


class _CountedAcks:
    """The store, counting the acks each activate_leases call carries, and
    asking for grouped acks (as PostgreSQL does; this test's store is SQLite)."""

    group_acks = True

    def __init__(self, store: Store) -> None:
        self._store = store
        self.groups: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def activate_leases(self, fences: Any, **kwargs: Any) -> Any:
        self.groups.append(len(fences))
        return await self._store.activate_leases(fences, **kwargs)


async def test_acks_of_many_runs_read_together_are_activated_as_one_group_and_a_stale_one_is_refused_alone(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    counted = _CountedAcks(store)
    cfg = NodeConfig(timings=Timings(), limits=Limits(max_slots_per_session=40))
    sock = Socket(counted, cfg)  # type: ignore[arg-type]
    await sock.send.send(register(slots=40))
    session_id = await nursery.start(sock.serve)
    await sock.answer()  # Registered
    for _ in range(30):
        await store.ingest_event("go", {}, None, idempotency_window_s=60)
    reserved = await store.reserve_segments(
        "n1", {session_id: frozenset({"fn"})}, 30, reservation_expiry_s=30
    )
    jobs = [r.assignment for r in reserved]
    stale = jobs[7]
    before = (await store.get_run(stale.run_id)).run.status
    for a in jobs:  # one read of the socket: every ack queued at once
        token = "0" * 32 if a is stale else a.lease_token
        sock.send.send_nowait(JobAck(a.job_id, a.run_id, a.execution_seq, token))
    refused = await sock.answer()
    assert isinstance(refused, Refused) and refused.run_id == stale.run_id
    for a in jobs:
        if a is not stale:
            await sock.until_status(a.run_id, "running")
    assert (await store.get_run(stale.run_id)).run.status == before != "running"
    assert sum(counted.groups) == 30 and len(counted.groups) <= 2, counted.groups


@pytest.mark.parametrize("delayed_start", [True, False])
async def test_a_job_result_hands_the_freed_credit_its_next_segment_without_a_dispatcher_round(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, delayed_start: bool
) -> None:
    """The completion's own transaction reserves the queued run for the credit
    it freed (Store.complete_jobs_and_reserve) and the session hands it out:
    no kick. A worker that cannot hold a job itself (no ``delayed_start``) is
    not offered work there: the dispatcher is kicked, as before."""
    sock = Socket(store)
    reg = Register(worker_id="w1", functions=[FN], max_concurrent_jobs=1, delayed_start=delayed_start)
    session_id = await sock.open(nursery, reg)
    a = await sock.assign(session_id)
    await sock.until_status(a.run_id, "running")
    queued = await store.ingest_event("go", {"next": 1}, None, idempotency_window_s=60)
    drained(sock.kicks)  # the session's opening kick
    await sock.send.send(JobCompleted(a.job_id, a.run_id, a.execution_seq, a.lease_token, "done"))
    await sock.until_status(a.run_id, "completed")
    if delayed_start:
        nxt = await sock.answer()
        assert isinstance(nxt, JobAssignment) and nxt.run_id == queued.run_ids[0]
        assert drained(sock.kicks) == []
    else:
        await trio.sleep(1)
        assert drained(sock.received) == []
        assert [k.why for k in drained(sock.kicks)] == ["job completed"]
        assert (await store.get_run(queued.run_ids[0])).run.status == "waiting_for_capacity"


class _CountedCalls(_CountedAcks):
    """:class:`_CountedAcks` that also counts the completion groups and which
    of their items came with their JobAck."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.activated_with_result: list[str] = []
        self.step_writes = 0

    async def record_steps(self, *args: Any, **kwargs: Any) -> Any:
        self.step_writes += 1
        return await self._store.record_steps(*args, **kwargs)

    async def record_steps_many(self, *args: Any, **kwargs: Any) -> Any:
        self.step_writes += 1
        return await self._store.record_steps_many(*args, **kwargs)

    async def complete_jobs_and_reserve(self, items: Any, **kwargs: Any) -> Any:
        self.activated_with_result += sorted(kwargs.get("activate", ()))
        return await self._store.complete_jobs_and_reserve(items, **kwargs)

    async def complete_jobs(self, items: Any, **kwargs: Any) -> Any:
        self.activated_with_result += sorted(kwargs.get("activate", ()))
        return await self._store.complete_jobs(items, **kwargs)


async def _reserved(store: Store, session_id: str) -> JobAssignment:
    await store.ingest_event("go", {}, None, idempotency_window_s=60)
    (res,) = await store.reserve_segments("n1", {session_id: frozenset({"fn"})}, 1, reservation_expiry_s=30)
    return res.assignment


async def _counted_session(store: Store, nursery: trio.Nursery) -> tuple[_CountedCalls, Socket, JobAssignment]:
    """A session over the counting store, and a segment reserved for it."""
    counted = _CountedCalls(store)
    sock = Socket(counted)  # type: ignore[arg-type]
    session_id = await sock.open(nursery)
    return counted, sock, await _reserved(store, session_id)


async def test_an_ack_followed_at_once_by_its_segment_is_applied_with_it_in_one_completion(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A short handler's JobAck, step results and job result: one grouped
    completion that activates the lease first — no activation of its own."""
    counted, sock, a = await _counted_session(store, nursery)
    fence = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
    await sock.send.send(JobAck(*fence))
    await trio.sleep(HOLD_S / 2)  # a later read of the socket, inside the hold
    await sock.send.send(StepCompleted(*fence, "s1", "s1", 1))
    await sock.send.send(JobCompleted(*fence, "done"))
    await sock.until_status(a.run_id, "completed")
    assert counted.groups == [] and counted.activated_with_result == [a.run_id]
    detail = await store.get_run(a.run_id)
    assert [s.output for s in detail.steps] == [1] and detail.run.output == "done"


async def test_an_ack_that_came_with_some_of_its_step_results_waits_for_its_segment_too(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The ack and the segment's first step result read together (one socket
    read), its last step and job result in a later one: still one grouped
    completion, not an activation and a step write of their own first."""
    counted, sock, a = await _counted_session(store, nursery)
    fence = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
    await sock.send.send(JobAck(*fence))
    await sock.send.send(StepCompleted(*fence, "s1", "s1", 1))
    await trio.sleep(HOLD_S / 2)
    await sock.send.send(StepCompleted(*fence, "s2", "s2", 2))
    await sock.send.send(JobCompleted(*fence, "done"))
    await sock.until_status(a.run_id, "completed")
    assert counted.groups == [] and counted.activated_with_result == [a.run_id]
    assert counted.step_writes == 0
    detail = await store.get_run(a.run_id)
    assert [s.output for s in detail.steps] == [1, 2] and detail.run.output == "done"


async def test_an_ack_whose_segment_goes_on_is_applied_alone_after_the_hold(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    counted = _CountedCalls(store)
    sock = Socket(counted)  # type: ignore[arg-type]
    session_id = await sock.open(nursery)
    a = await _reserved(store, session_id)
    await sock.send.send(JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
    await trio.sleep(HOLD_S * 0.8)
    assert (await store.get_run(a.run_id)).run.status != "running"  # held
    await trio.sleep(HOLD_S)
    assert (await store.get_run(a.run_id)).run.status == "running"
    assert counted.groups == [1] and counted.activated_with_result == []


async def test_a_held_ack_is_applied_at_once_when_the_socket_closes(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Frames read before a socket drops are applied before its leases are
    recovered: the held ack is applied (not dropped, not waited out)."""
    counted = _CountedCalls(store)
    sock = Socket(counted)  # type: ignore[arg-type]
    session_id = await sock.open(nursery)
    a = await _reserved(store, session_id)
    await sock.send.send(JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
    await trio.sleep(0)
    await sock.send.aclose()
    with trio.fail_after(HOLD_S / 2):
        while await store.list_sessions():
            await trio.sleep(0.0001)
    assert counted.groups == [1]  # activated, then recovered with the session
    assert (await store.get_run(a.run_id)).run.recovery_count == 1


async def test_a_job_result_also_kicks_the_dispatcher_when_a_session_was_not_offered_work(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The completion's round offers work only to workers that hold jobs
    themselves; with another session connected (a worker without
    ``delayed_start``) the dispatcher is kicked for it as well."""
    sock = Socket(store)
    reg = Register(worker_id="w1", functions=[FN], max_concurrent_jobs=1, delayed_start=True)
    session_id = await sock.open(nursery, reg)
    other_outbox, _ = trio.open_memory_channel[EngineMessage](10)
    sock.directory.add(LocalSession("other", frozenset({"fn"}), other_outbox, delayed_start=False))
    a = await sock.assign(session_id)
    await sock.until_status(a.run_id, "running")
    queued = await store.ingest_event("go", {}, None, idempotency_window_s=60)
    drained(sock.kicks)
    await sock.send.send(JobCompleted(a.job_id, a.run_id, a.execution_seq, a.lease_token, "done"))
    nxt = await sock.answer()
    assert isinstance(nxt, JobAssignment) and nxt.run_id == queued.run_ids[0]
    assert [k.why for k in drained(sock.kicks)] == ["job completed"]


async def test_with_no_ack_hold_an_ack_is_applied_as_it_comes(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    counted = _CountedCalls(store)
    cfg = NodeConfig(timings=Timings(ack_hold_s=0), limits=Limits(max_slots_per_session=8))
    sock = Socket(counted, cfg)  # type: ignore[arg-type]
    session_id = await sock.open(nursery)
    a = await _reserved(store, session_id)
    await sock.send.send(JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
    await sock.until_status(a.run_id, "running")
    assert trio.current_time() < HOLD_S  # not held (the default would hold it that long)
    assert counted.groups == [1]
