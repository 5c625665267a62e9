"""Fixtures for SDK tests; the fake engine lives in ``sdk_fake_engine``.

The SDK's tests run on both AnyIO backends (``anyio_backend``: asyncio and
trio), the way a user's program runs the SDK under ``asyncio.run`` or
``trio.run``. A module opts in with ``pytestmark = pytest.mark.anyio``; the
held-start tests that need Trio's virtual clock stay on Trio alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest
from sdk_fake_engine import FakeEngine, ListReporter, make_assignment


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group around the test, cancelled when it ends (pytest-trio's ``nursery``)."""
    async with anyio.create_task_group() as tg:
        yield tg
        tg.cancel_scope.cancel()


@pytest.fixture
async def engine(task_group: anyio.abc.TaskGroup) -> FakeEngine:
    e = FakeEngine()
    await e.start(task_group)
    return e


@pytest.fixture
def assignment_factory():
    return make_assignment


@pytest.fixture
def list_reporter():
    return ListReporter()
