"""The store monitor's read probe in virtual time: a probe that does not answer
within its timeout marks the store down, unless other calls reached the
database meanwhile (the probe was queued behind a loaded node's work) or a
direct probe, on a connection of its own, answered (the node's calls all
wait on locks)."""

from __future__ import annotations

from typing import Any

import outcome
import trio
import trio.testing

from actors.store_monitor import _probe
from ironflow.store import StoreUnavailable
from ironflow.store.availability import Availability, settle

TIMEOUT_S = 0.5


class SlowStore:
    """Only what the probe touches: its availability and a probe that takes
    ``probe_s`` queued behind the node's calls, ``direct_s`` on its own."""

    def __init__(self, probe_s: float, direct_s: float | None = None) -> None:
        self.availability = Availability()
        self.probe_s = probe_s
        self.direct_s = probe_s if direct_s is None else direct_s
        self.asked: list[tuple[float, bool]] = []  # (when, direct)

    async def probe(self, *, write: bool, direct: bool = False) -> None:
        self.asked.append((trio.current_time(), direct))
        await trio.sleep(self.direct_s if direct or write else self.probe_s)


async def probed(store: Any, *, others_reach_at: float | None, write: bool = False) -> bool:
    answer: list[bool] = []
    async with trio.open_nursery() as nursery:
        if others_reach_at is not None:
            async def other_call() -> None:
                await trio.sleep(others_reach_at)
                store.availability.reached()

            nursery.start_soon(other_call)
        answer.append(await _probe(store, TIMEOUT_S, write=write))
    return answer[0]


async def test_a_probe_queued_behind_work_that_reaches_the_database_is_not_an_outage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = SlowStore(probe_s=2.0, direct_s=60.0)
    assert await probed(store, others_reach_at=0.3)
    assert store.availability.up


async def test_calls_that_all_wait_on_locks_are_no_outage_when_a_direct_probe_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Every connection of the node waits on a lock (a deadlock PostgreSQL
    # breaks after 1 s): nothing of the node's reaches the database, yet it answers.
    store = SlowStore(probe_s=1.0, direct_s=0.01)
    started = trio.current_time()
    assert await probed(store, others_reach_at=None)
    assert store.availability.up
    assert [(round(t - started, 3), direct) for t, direct in store.asked] == [(0.0, False), (0.1, True)]
    assert round(trio.current_time() - started, 3) == 0.11


async def test_a_silent_database_is_an_outage_at_the_probe_timeout(autojump_clock: trio.testing.MockClock) -> None:
    store = SlowStore(probe_s=60.0)
    started = trio.current_time()
    assert not await probed(store, others_reach_at=None)
    assert not store.availability.up and "store_probe_timeout_s" in store.availability.cause
    assert trio.current_time() - started == TIMEOUT_S
    # A call that reached it before the probe began proves nothing about now.
    again = SlowStore(probe_s=60.0)
    again.availability.reached()
    await trio.sleep(1)
    assert not await probed(again, others_reach_at=None)
    assert not again.availability.up


async def test_a_write_probe_must_itself_go_through(autojump_clock: trio.testing.MockClock) -> None:
    store = SlowStore(probe_s=60.0)
    assert not await probed(store, others_reach_at=0.1, write=True)


async def test_a_probe_that_answers_in_time_is_up(autojump_clock: trio.testing.MockClock) -> None:
    store = SlowStore(probe_s=0.05)
    assert await probed(store, others_reach_at=None)
    assert store.availability.up
    assert store.asked == [(0.0, False)], "a queued probe that answers needs no direct one"


class RefusingDirectStore(SlowStore):
    """A database that refuses a new connection while the node's calls hang."""

    async def probe(self, *, write: bool, direct: bool = False) -> None:
        if direct:
            self.availability.went_down("STORE_UNAVAILABLE", "connection refused")
            raise StoreUnavailable("connection refused")
        await trio.sleep(self.probe_s)


async def test_a_direct_probe_refused_is_an_outage_at_once(autojump_clock: trio.testing.MockClock) -> None:
    store = RefusingDirectStore(probe_s=60.0)
    started = trio.current_time()
    assert not await probed(store, others_reach_at=None)
    assert not store.availability.up and store.availability.cause == "connection refused"
    assert round(trio.current_time() - started, 3) == 0.1


async def test_a_store_call_given_up_on_does_not_count_as_reaching_the_database(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A direct probe abandoned at the timeout comes back as Cancelled: it heard
    # nothing from the database, so it must not hide the outage it timed out on.
    availability = Availability()
    with trio.move_on_after(0.1):
        result = await outcome.acapture(trio.sleep, 60)
        settle(availability, result, lambda exc: None)
    assert availability.last_ok == 0.0
    assert availability.up
