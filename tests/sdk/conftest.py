"""Fixtures for SDK tests; the fake engine lives in ``sdk_fake_engine``."""

from __future__ import annotations

import pytest
import trio
from sdk_fake_engine import FakeEngine, ListReporter, make_assignment


@pytest.fixture
async def engine(nursery: trio.Nursery) -> FakeEngine:
    e = FakeEngine()
    await e.start(nursery)
    return e


@pytest.fixture
def assignment_factory():
    return make_assignment


@pytest.fixture
def list_reporter():
    return ListReporter()
