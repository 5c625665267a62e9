"""The supervisor restarts a crashed actor with backoff and keeps the others running."""

from __future__ import annotations

import trio
import trio.testing

from actors.supervisor import Supervisor
from ironflow.config import Timings


async def test_crashing_actor_is_restarted_with_doubling_backoff(autojump_clock: trio.testing.MockClock) -> None:
    starts: list[float] = []

    async def flaky(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        starts.append(trio.current_time())
        task_status.started()
        if len(starts) <= 3:
            raise RuntimeError("boom")
        await trio.sleep_forever()

    timings = Timings(restart_backoff_s=1.0, restart_backoff_max_s=3.0)
    async with trio.open_nursery() as nursery:
        sup = Supervisor(nursery, timings)
        await sup.start("flaky", flaky)
        await trio.sleep(100)
        assert sup.restarts("flaky") == 3
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 3) for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == [1.0, 2.0, 3.0]  # 1 s, ×2, capped at 3 s


async def test_injected_crash_restarts_only_that_actor(autojump_clock: trio.testing.MockClock) -> None:
    runs = {"a": 0, "b": 0}

    def make(name: str):  # type: ignore[no-untyped-def]
        async def actor(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            runs[name] += 1
            task_status.started()
            await trio.sleep_forever()

        return actor

    async with trio.open_nursery() as nursery:
        sup = Supervisor(nursery, Timings(restart_backoff_s=0.5))
        await sup.start("a", make("a"))
        await sup.start("b", make("b"))
        sup.crash("a")
        await trio.sleep(1)
        assert runs == {"a": 2, "b": 1}
        assert sup.restarts("a") == 1 and sup.restarts("b") == 0
        nursery.cancel_scope.cancel()


async def test_actor_that_returns_is_not_restarted(autojump_clock: trio.testing.MockClock) -> None:
    count = 0

    async def once(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal count
        count += 1
        task_status.started()

    async with trio.open_nursery() as nursery:
        sup = Supervisor(nursery, Timings())
        await sup.start("once", once)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert count == 1


async def test_crash_during_restart_backoff_is_refused_and_not_kept_for_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts = 0

    async def fails_once_then_returns(
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        nonlocal starts
        starts += 1
        task_status.started()
        if starts == 1:
            raise RuntimeError("boom")

    async with trio.open_nursery() as nursery:
        sup = Supervisor(nursery, Timings(restart_backoff_s=1.0))
        await sup.start("a", fails_once_then_returns)
        await trio.sleep(0.5)  # inside the 1 s backoff: nothing runs to crash
        assert sup.crash("a") is False
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    # The second start returned cleanly: a request kept from the backoff would
    # have turned that exit into a crash and a third start.
    assert starts == 2 and sup.restarts("a") == 1
