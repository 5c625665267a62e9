"""The drain coordinator in virtual time: a node drain as Shutdown frames and a deadline.

A "worker" here is a ``LocalSession`` whose outbox the test reads; the store
(SQLite, inline on the Trio thread) holds no pull session of this node unless
a test puts one there, so only the directory's sessions hold the drain up.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from actors import drain_coordinator
from actors.directory import LocalSession, SessionDirectory
from ironflow.config import NodeConfig, Timings
from ironflow.protocol import EngineMessage, Shutdown
from ironflow.store import Store

DRAIN_S = 25.0
CFG = NodeConfig(timings=Timings(drain_timeout_s=DRAIN_S))






class Node:
    """The pieces of a node the coordinator sees: its store, directory and two events."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.directory = SessionDirectory()
        self.shutdown_requested = trio.Event()
        self.drained = trio.Event()
        self.outboxes: dict[str, trio.MemoryReceiveChannel[EngineMessage]] = {}

    def connect(self, session_id: str, *, mode: str = "stream", capacity: int = 10) -> LocalSession:
        send, receive = trio.open_memory_channel[EngineMessage](capacity)
        session = LocalSession(session_id, frozenset({"fn"}), send, mode=mode)
        self.directory.add(session)
        self.outboxes[session_id] = receive
        return session

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(
            drain_coordinator.run,
            self.store,
            CFG,
            "node-a",
            self.directory,
            self.shutdown_requested,
            self.drained,
        )

    async def drained_at(self) -> float:
        with trio.fail_after(10 * DRAIN_S):
            await self.drained.wait()
        return trio.current_time()


async def leave_at(directory: SessionDirectory, session_id: str, at: float) -> None:
    """The worker finishes its running jobs, half-closes, and its session goes at ``at``."""
    await trio.sleep_until(at)
    directory.remove(session_id)


async def test_a_node_drain_sends_shutdown_with_the_deadline_to_every_streaming_session(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    node = Node(store)
    streams = [node.connect("s1"), node.connect("s2")]
    pull = node.connect("p1", mode="pull")
    await node.start(nursery)
    node.shutdown_requested.set()
    await trio.sleep(0.001)
    for session in streams:
        assert node.outboxes[session.session_id].receive_nowait() == Shutdown(
            "engine node shutting down", int(DRAIN_S * 1000)
        )
        assert session.draining
    # A pull worker has no socket to hear a Shutdown: its next poll answers it
    # (the directory's drain deadline); meanwhile it too is offered no work.
    with pytest.raises(trio.WouldBlock):
        node.outboxes["p1"].receive_nowait()
    assert pull.draining and set(node.directory.offers()) == set()
    assert node.directory.drain_deadline == pytest.approx(DRAIN_S, abs=0.01)


async def test_nothing_is_sent_before_a_drain_is_requested(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    node = Node(store)
    session = node.connect("s1")
    await node.start(nursery)
    await trio.sleep(1000.0)
    with pytest.raises(trio.WouldBlock):
        node.outboxes["s1"].receive_nowait()
    assert not session.draining and not node.drained.is_set()


async def test_the_drain_waits_for_the_last_streaming_session_to_leave(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ironflow.drain")
    node = Node(store)
    node.connect("s1")
    node.connect("s2")
    node.connect("p1", mode="pull")  # a pull session does not hold the drain up
    await node.start(nursery)
    nursery.start_soon(leave_at, node.directory, "s1", 3.0)
    nursery.start_soon(leave_at, node.directory, "s2", 7.0)
    node.shutdown_requested.set()
    assert await node.drained_at() == 7.0
    assert [r.getMessage() for r in caplog.records][-1] == "drain: complete"


async def test_at_the_drain_deadline_drained_is_set_with_sessions_still_connected(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ironflow.drain")
    node = Node(store)
    node.connect("s1")
    node.connect("stuck")  # its job outlives the deadline: it recovers through loop 1
    await node.start(nursery)
    await trio.sleep(100.0)
    nursery.start_soon(leave_at, node.directory, "s1", 102.0)
    node.shutdown_requested.set()
    assert await node.drained_at() == 100.0 + DRAIN_S
    assert [s.session_id for s in node.directory.streaming()] == ["stuck"]
    last = caplog.records[-1]
    assert last.getMessage() == "drain: deadline reached" and last.levelno == logging.WARNING


async def test_with_no_streaming_session_the_drain_completes_at_once(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    node = Node(store)
    node.connect("p1", mode="pull")
    await node.start(nursery)
    await trio.sleep(5.0)
    node.shutdown_requested.set()
    assert await node.drained_at() == 5.0


async def test_a_full_or_closed_outbox_does_not_stop_the_others_hearing_shutdown(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    node = Node(store)
    full = node.connect("full", capacity=0)  # nobody reading: send_nowait would block
    gone = node.connect("gone")
    node.outboxes["gone"].close()  # the socket went: the send end is broken
    node.connect("ok")
    await node.start(nursery)
    node.shutdown_requested.set()
    await trio.sleep(0.001)
    assert isinstance(node.outboxes["ok"].receive_nowait(), Shutdown)
    assert full.draining and gone.draining
    # They still count until they leave.
    nursery.start_soon(leave_at, node.directory, "ok", 1.0)
    nursery.start_soon(leave_at, node.directory, "full", 2.0)
    nursery.start_soon(leave_at, node.directory, "gone", 4.0)
    assert await node.drained_at() == 4.0
