"""The transaction surface the shared SQL is written against (:class:`Tx`) and
the value codecs every store module uses (JSON text columns, ISO times,
``?`` placeholder lists).

Below every other module of the SQL store: it imports none of them, so any
of them (``core.py`` and the mechanisms it calls) can import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec

from ironflow.protocol import ErrorInfo

json_encode = msgspec.json.Encoder().encode
json_decode = msgspec.json.Decoder().decode
error_decode = msgspec.json.Decoder(ErrorInfo).decode


class Tx(Protocol):
    """The tiny transaction surface the shared SQL is written against."""

    # The dialect differences the shared SQL asks about, each a capability
    # named for its question; where a function has two forms, both are written
    # side by side in it (tests/store/test_statement_forms.py: the same rows).
    #
    # Whether INSERT/UPDATE/DELETE may stand inside WITH (PostgreSQL): a
    # transition over several tables is then one statement, its later parts
    # seeing what the earlier ones returned. SQLite has no data-modifying
    # WITH: one statement per table, its single writer making them one step.
    modifying_with: bool
    # Whether every statement is a round trip to a server (PostgreSQL): reads
    # that could be two statements are folded into one. SQLite runs
    # in-process and has no round trips to save.
    round_trips: bool
    # Whether a NOTIFY reaches every node at commit (PostgreSQL); SQLite has one node.
    notifies_nodes: bool
    # True where a SELECT's rows are read from the database as they are
    # iterated (SQLite: one step of the statement each), False where a result
    # arrives whole at execute (PostgreSQL). A page capped in bytes
    # (store/pages.py) stops reading at the cap where rows stream, and measures
    # its rows' sizes first where they do not.
    streams_rows: bool

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the affected row count."""

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None: ...

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def iterate(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple[Any, ...]]:
        """The rows of one SELECT, one at a time (see :attr:`streams_rows`);
        leaving the loop early ends the statement."""

    def lock(self, of: str | None = None) -> str:
        """``FOR UPDATE [OF of] SKIP LOCKED`` on PostgreSQL, ``""`` on SQLite."""

    def lock_wait(self) -> str:
        """``FOR UPDATE`` (waits for a concurrent holder) on PostgreSQL, ``""`` on SQLite."""

    def runs_ended(self, run_ids: list[str]) -> None:
        """These runs end in this transaction: tell the other nodes at commit."""

    def notify(self) -> None:
        """Tell every node's dispatcher, at commit, that queue rows became claimable."""

    def take_notify(self) -> bool:
        """Whether this call asked for :meth:`notify` so far, withdrawing the ask
        (it can be made again): the emit that reserved every run it queued
        kicks nobody (``SqlStore.ingest_and_reserve``)."""

    def share_lock(self, of: str) -> str:
        """``FOR SHARE OF of`` (waits) on PostgreSQL, ``""`` on SQLite."""

    def advisory_lock(self, key: str) -> None:
        """Transaction-scoped named lock on PostgreSQL; a no-op on SQLite."""

    def try_advisory_lock(self, key: str) -> bool:
        """Take the transaction-scoped named lock if free (PostgreSQL); True on SQLite."""

    def key_share_lock(self, of: str) -> str:
        """``FOR KEY SHARE OF of`` on PostgreSQL (waits for a DELETE of the row,
        not for an UPDATE of its other columns), ``""`` on SQLite."""

    def renew_lock(self, of: str) -> str:
        """``FOR NO KEY UPDATE OF of SKIP LOCKED`` on PostgreSQL (what an UPDATE
        of non-key columns takes, skipping a row another transaction is
        deleting or locked for update; a ``FOR KEY SHARE`` holder is not
        skipped), ``""`` on SQLite."""

    # SQL for this transaction's id (PostgreSQL: ``pg_current_xact_id()``, the
    # number :meth:`snapshot_sql`'s snapshot is judged against), ``NULL`` on SQLite.
    xid_sql: str
    # SQL for the current statement's snapshot as text (PostgreSQL), ``NULL`` on SQLite.
    snapshot_sql: str


def enc(value: Any) -> str:
    return json_encode(value).decode()


def dec(text: str | None) -> Any:
    return None if text is None else json_decode(text)


def dec_error(text: str | None) -> ErrorInfo | None:
    return None if text is None else error_decode(text)


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def placeholders(n: int) -> str:
    return ", ".join("?" * n)
