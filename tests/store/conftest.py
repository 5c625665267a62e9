"""Fixtures of the PostgreSQL store tests that force an interleaving: one
store (one node's connection pool), or two on one database (two nodes, the
first hooked so a test can hold its transaction before its commit)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ironflow.store.postgres import PostgresStore
from tests.store.pg_holds import HookedStore


@pytest.fixture
async def postgres_store(pg_url: str) -> AsyncIterator[PostgresStore]:
    """An opened PostgreSQL store on the test database."""
    s = PostgresStore(pg_url)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def stores(pg_url: str) -> AsyncIterator[tuple[HookedStore, PostgresStore]]:
    """Two stores on one database: two nodes' connection pools."""
    a, b = HookedStore(pg_url), PostgresStore(pg_url)
    await a.open()
    await b.open()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()
