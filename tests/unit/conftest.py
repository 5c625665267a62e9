"""Actors in virtual time: a real SQLite store running inline on the Trio thread.

Inline, no thread ever holds a request, so ``MockClock(autojump_threshold=0)``
cannot jump while the database works, and ``ironflow_now()`` reads the
virtual clock (``BASE + trio.current_time()``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from ironflow.store import Store
from ironflow.store.sqlite import SqliteStore
from tests.unit.virtual_time import BASE


@pytest.fixture
async def store(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> AsyncIterator[Store]:
    s = SqliteStore(str(tmp_path / "vt.db"), now=lambda: BASE + trio.current_time(), inline=True)
    await s.open()
    yield s
    await s.close()
