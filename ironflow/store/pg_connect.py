"""PostgreSQL connections: how the node connects (any libpq URL, multi-host
failover included), which driver errors mean an outage rather than a fault
(``ironflow/store/availability.py``), and the refusal of a read-only server."""

from __future__ import annotations

from typing import Any

import psycopg

from ironflow.config import redact_url
from ironflow.store.errors import StorageFull, StoreReadOnly, StoreUnavailable

# SQLSTATE classes that mean the server is unreachable or cannot serve now,
# not that the statement was wrong: connection exception (08), insufficient
# resources (53: disk full, out of memory, too many connections), operator
# intervention (57: shutting down, starting up, in recovery), system error (58).
_OUTAGE_CLASSES = ("08", "53", "57", "58")
# ...except a statement cancelled on purpose (57014: statement_timeout, cancel).
_NOT_OUTAGES = ("57014",)
# Seconds a connection attempt may take (unless the URL sets connect_timeout):
# a partitioned server then fails a call within the API's 5 s instead of
# hanging it for the operating system's TCP timeout.
CONNECT_TIMEOUT_S = 3


def unavailable(exc: BaseException) -> StoreUnavailable | None:
    """The outage ``exc`` (a psycopg error) means, or None for any other error."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, psycopg.errors.DiskFull):
        return StorageFull(f"PostgreSQL storage full: {first}")
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return StoreUnavailable(
            f"PostgreSQL is read-only (a standby, or a primary being demoted): {first}"
        )
    if isinstance(exc, psycopg.InterfaceError):
        return StoreUnavailable(f"PostgreSQL connection lost: {first}")
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate
        if state is None or (state[:2] in _OUTAGE_CLASSES and state not in _NOT_OUTAGES):
            return StoreUnavailable(f"PostgreSQL unavailable: {first}")
    if type(exc) is psycopg.DatabaseError and exc.sqlstate is None:
        # libpq's own failure with no server answer ("server closed the
        # connection unexpectedly" from a statement on a dead connection).
        return StoreUnavailable(f"PostgreSQL unavailable: {first}")
    return None


def connect(url: str) -> psycopg.Connection[Any]:
    """An autocommit connection to ``url`` (any libpq URL, multi-host included)."""
    extra: dict[str, Any] = {}
    if "connect_timeout" not in url:
        extra["connect_timeout"] = CONNECT_TIMEOUT_S
    return psycopg.connect(url, autocommit=True, **extra)



def refuse_read_only(conn: psycopg.Connection[Any], url: str) -> None:
    """Raise StoreReadOnly if ``conn`` reached a server that only reads."""
    row = conn.execute(
        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
    ).fetchone()
    if row is None:
        return
    in_recovery, read_only = bool(row[0]), row[1] == "on"
    if in_recovery or read_only:
        why = "a standby in recovery" if in_recovery else "default_transaction_read_only is on"
        raise StoreReadOnly(
            f"the database at {redact_url(url)} is read-only ({why}): a node must write;"
            " point --db at the primary, or list every host in the URL with"
            " target_session_attrs=read-write"
        )
