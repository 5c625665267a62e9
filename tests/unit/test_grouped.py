"""actors/grouped.py: items of concurrent callers applied together, in virtual time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import outcome
import pytest
import trio
import trio.testing

from actors.grouped import Grouped


class Apply:
    """A batch method that takes 1 s and records each group it was given."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []

    async def __call__(self, items: list[int]) -> list[outcome.Outcome[int]]:
        self.groups.append(items)
        await trio.sleep(1)
        return [outcome.Error(ValueError(f"bad {i}")) if i < 0 else outcome.Value(i * 10) for i in items]


def _calls(apply: Apply) -> tuple[Grouped[int, int], dict[int, int], Callable[[int], Awaitable[None]]]:
    """A Grouped over ``apply``, the results its callers got, and a caller."""
    grouped: Grouped[int, int] = Grouped(apply)
    got: dict[int, int] = {}

    async def call(i: int) -> None:
        got[i] = await grouped(i)

    return grouped, got, call


async def test_one_item_alone_is_applied_at_once_and_the_ones_that_queue_meanwhile_form_the_next_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    apply = Apply()
    grouped: Grouped[int, int] = Grouped(apply)
    got: dict[int, object] = {}

    async def call(i: int) -> None:
        try:
            got[i] = await grouped(i)
        except ValueError as exc:
            got[i] = str(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, 1)
        await trio.sleep(0.5)  # 1 is being applied
        for i in (2, -3, 4):
            nursery.start_soon(call, i)
    assert [sorted(group) for group in apply.groups] == [[1], [-3, 2, 4]]  # (tasks start in any order)
    assert got == {1: 10, 2: 20, -3: "bad -3", 4: 40}  # each its own outcome
    assert trio.current_time() == pytest.approx(2.0)


async def test_a_caller_cancelled_while_queued_is_not_applied_and_the_rest_go_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    apply = Apply()
    grouped, got, call = _calls(apply)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, 1)
        await trio.sleep(0.5)
        with trio.move_on_after(0.1):
            await grouped(2)  # queued behind 1's group, then cancelled
        nursery.start_soon(call, 3)
    assert apply.groups == [[1], [3]] and got == {1: 10, 3: 30}


async def test_an_apply_that_raises_tells_every_item_of_its_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def broken(items: list[int]) -> list[outcome.Outcome[int]]:
        raise OSError("database gone")

    grouped: Grouped[int, int] = Grouped(broken)
    errors: list[str] = []

    async def call(i: int) -> None:
        with pytest.raises(OSError) as exc:
            await grouped(i)
        errors.append(str(exc.value))

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(call, i)
    assert errors == ["database gone"] * 3


async def test_a_caller_cancelled_while_its_group_is_applied_gets_its_committed_result(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its item went with a group another caller applies: the write commits, so
    the cancelled caller returns its result (then is cancelled at its next
    checkpoint), never an error that would say the write did not happen."""
    apply = Apply()
    grouped: Grouped[int, int] = Grouped(apply)
    got: dict[str, object] = {}
    grouped._busy = True  # another caller's group is being applied: 3 queues

    async def call_3() -> None:
        with trio.CancelScope(deadline=trio.current_time() + 0.5):  # cancelled mid-apply
            got["3"] = await grouped(3)
            got["after"] = "returned"
            await trio.sleep(0)
            got["after checkpoint"] = "not cancelled"

    async def other_caller() -> None:
        await trio.sleep(0.1)
        await grouped._apply_next()  # takes 3's item into its group, applied 0.1 → 1.1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call_3)
        nursery.start_soon(other_caller)
    assert apply.groups == [[3]]
    assert got == {"3": 30, "after": "returned"}  # its result, then its cancellation


class _Steps(trio.abc.Instrument):
    """How many times each task ran (was woken) from now on."""

    def __init__(self) -> None:
        self.by_task: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.by_task[task.name] = self.by_task.get(task.name, 0) + 1


async def test_a_queued_caller_is_woken_once_and_the_first_in_the_queue_to_apply_the_next_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ten callers queued behind a group: when it is done only the first is
    woken (to apply theirs, and again when the store returns); each other
    sleeps until its group is done. (Waking all of them at each group's end
    cost every caller a second task switch.)"""
    apply = Apply()
    grouped, got, call = _calls(apply)
    steps = _Steps()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, 0, name="first")
        await trio.sleep(0.5)  # 0 is being applied
        for i in range(1, 11):
            nursery.start_soon(call, i, name=f"queued {i}")
        await trio.sleep(0.1)  # all ten queued
        trio.lowlevel.add_instrument(steps)
    trio.lowlevel.remove_instrument(steps)
    assert [sorted(group) for group in apply.groups] == [[0], list(range(1, 11))]
    assert got == {i: i * 10 for i in range(11)}
    queued = sorted(n for name, n in steps.by_task.items() if name.startswith("queued"))
    # The first in the queue: woken to apply the group, then by its sleep's
    # end; every other: woken once, its result in.
    assert queued == [1] * 9 + [2], steps.by_task


async def test_when_the_first_queued_caller_is_cancelled_the_next_applies_the_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    apply = Apply()
    grouped, got, call = _calls(apply)
    with trio.fail_after(10):  # (a queue nobody applies would wait for ever)
        await _first_cancelled(grouped, call)
    assert apply.groups == [[1], [3]] and got == {1: 10, 3: 30}
    assert trio.current_time() == pytest.approx(2.0)


async def _first_cancelled(grouped: Grouped[int, int], call: Callable[[int], Awaitable[None]]) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, 1)
        await trio.sleep(0.5)  # 1 is being applied

        async def cancelled_first() -> None:
            with trio.move_on_after(0.2):
                await grouped(2)  # first in the queue, gone before its turn

        nursery.start_soon(cancelled_first)
        await trio.sleep(0.1)
        nursery.start_soon(call, 3)  # second in the queue
