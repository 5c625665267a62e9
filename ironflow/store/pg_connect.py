"""PostgreSQL connections: how the node connects (any libpq URL, multi-host
failover included), which driver errors mean an outage rather than a fault
(``ironflow/store/availability.py``), and the refusal of a read-only server."""

from __future__ import annotations

from typing import Any

import psycopg

from ironflow.config import Timings, redact_url
from ironflow.store.errors import (
    StorageFull,
    StoreError,
    StoreReadOnly,
    StoreTimeout,
    StoreUnavailable,
)

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


def unavailable(exc: BaseException) -> StoreError | None:
    """The outage ``exc`` (a psycopg error) means, the timeout it is (a
    statement or lock wait ended at one of the node's bounds: StoreTimeout,
    not an outage), or None for any other error."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return StoreTimeout(f"PostgreSQL gave up waiting for a lock (timings.pg_lock_timeout_s): {first}")
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return StoreTimeout(
            f"PostgreSQL cancelled a statement (timings.pg_statement_timeout_s): {first}"
        )
    if isinstance(exc, psycopg.errors.DiskFull):
        return StorageFull(f"PostgreSQL storage full: {first}")
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return StoreUnavailable(
            f"PostgreSQL is read-only (a standby, or a primary being demoted): {first}"
        )
    if isinstance(exc, psycopg.errors.IdleInTransactionSessionTimeout):
        # Past idle_in_transaction_session_timeout: the node could not reach the
        # server (a group's statements follow each other within milliseconds).
        return StoreUnavailable(f"PostgreSQL ended this node's session, idle in a transaction: {first}")
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


# Keepalive probes sent before a silent connection counts as dead: with the
# idle time and the interval between probes, about pg_tcp_timeout_s in all.
KEEPALIVE_PROBES = 3


def _tcp_params(timings: Timings) -> dict[str, Any]:
    """libpq's TCP settings bounding how long a dead connection goes unnoticed:
    ``tcp_user_timeout`` while data waits for an acknowledgement, keepalives
    while the connection is silent (idle + probes × interval ≈ the timeout)."""
    total = timings.pg_tcp_timeout_s
    step = max(1, round(total / (KEEPALIVE_PROBES + 1)))  # libpq takes whole seconds
    return {
        "keepalives": 1,
        "keepalives_idle": step,
        "keepalives_interval": step,
        "keepalives_count": KEEPALIVE_PROBES,
        "tcp_user_timeout": max(1, round(total * 1000)),
    }


def connect(url: str, timings: Timings | None = None) -> psycopg.Connection[Any]:
    """An autocommit connection to ``url`` (any libpq URL, multi-host included),
    with ``timings``' TCP bounds (a setting the URL names itself is the URL's)."""
    extra: dict[str, Any] = {}
    if "connect_timeout" not in url:
        extra["connect_timeout"] = CONNECT_TIMEOUT_S
    if timings is not None:
        extra.update({k: v for k, v in _tcp_params(timings).items() if k not in url})
    return psycopg.connect(url, autocommit=True, **extra)


def session_bounds(timings: Timings) -> str:
    """The ``SET`` statements bounding every wait of a node's session on the
    server: a statement, a lock wait, and a transaction left idle (a node cut
    off mid-transaction), each ended by the server past its timing. One simple
    query, sent with the connection's other settings (no round trip of its own);
    ``SET`` rather than startup ``options`` so a pooler in front still accepts it."""
    bounds = {
        "statement_timeout": timings.pg_statement_timeout_s,
        "lock_timeout": timings.pg_lock_timeout_s,
        "idle_in_transaction_session_timeout": timings.pg_idle_in_transaction_timeout_s,
    }
    return "; ".join(f"SET {name} = {max(1, round(s * 1000))}" for name, s in bounds.items())



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
