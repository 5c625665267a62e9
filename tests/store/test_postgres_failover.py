"""PostgreSQL failover: a multi-host URL finds the writable server; a node
pointed at a read-only one (a standby, ``default_transaction_read_only``)
refuses to start with a clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from ironflow.store import StoreReadOnly, StoreUnavailable, open_store
from tests.integration.procs import ROOT, free_port


def _read_only(pg_url: str) -> None:
    name = pg_url.rsplit("/", 1)[1]
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')


async def test_a_store_on_a_read_only_database_refuses_to_open(pg_url: str) -> None:
    _read_only(pg_url)
    store = open_store(pg_url)
    with pytest.raises(StoreReadOnly, match="read-only .*default_transaction_read_only.*primary"):
        await store.open()


async def test_a_store_on_an_unreachable_server_raises_store_unavailable() -> None:
    store = open_store(f"postgresql://postgres@127.0.0.1:{free_port()}/nothing")
    with pytest.raises(StoreUnavailable, match="PostgreSQL unavailable"):
        await store.open()


async def test_a_multi_host_url_with_target_session_attrs_reaches_the_writable_host(
    pg_url: str,
) -> None:
    # The first host refuses connections (as a failed primary would); libpq
    # tries the next one, which accepts writes.
    rest = pg_url.split("://", 1)[1]
    user, hostport_db = rest.split("@", 1)
    hostport, db = hostport_db.split("/", 1)
    url = f"postgresql://{user}@127.0.0.1:{free_port()},{hostport}/{db}?target_session_attrs=read-write"
    store = open_store(url)
    await store.open()
    try:
        ingested = await store.ingest_event("failover.check", {}, None, idempotency_window_s=60.0)
        assert ingested.event_id
        await store.probe(write=True)
    finally:
        await store.close()


def test_a_node_pointed_at_a_read_only_database_exits_with_a_clear_error(
    pg_url: str, tmp_path: Path
) -> None:
    _read_only(pg_url)
    done = subprocess.run(
        [sys.executable, "-m", "ironflow.node", "--db", pg_url, "--port", str(free_port()),
         "--state-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "error: cannot start on" in done.stderr
    assert "is read-only (default_transaction_read_only is on): a node must write" in done.stderr
    assert "Traceback" not in done.stderr
