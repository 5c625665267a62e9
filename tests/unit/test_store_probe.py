"""The store monitor's read probe in virtual time: a probe that does not answer
within its timeout marks the store down, unless other calls reached the
database meanwhile (the probe was queued behind a loaded node's work)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from actors.store_monitor import _probe
from ironflow.store.availability import Availability

TIMEOUT_S = 0.5


class SlowStore:
    """Only what the probe touches: its availability and a probe that takes ``probe_s``."""

    def __init__(self, probe_s: float) -> None:
        self.availability = Availability()
        self.probe_s = probe_s

    async def probe(self, *, write: bool) -> None:
        await trio.sleep(self.probe_s)


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
    store = SlowStore(probe_s=2.0)
    assert await probed(store, others_reach_at=0.3)
    assert store.availability.up


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
    store = SlowStore(probe_s=0.1)
    assert await probed(store, others_reach_at=None)
    assert store.availability.up
