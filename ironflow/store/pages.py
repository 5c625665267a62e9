"""Pages of a list: keyset-paged on a key that never changes, capped in rows and in bytes.

The order. Each list is read in the order of a key its row gets when it is
inserted and keeps: a timestamp column, then the (unique) id. The page
after a cursor is ``WHERE (ts, id) < (?, ?) ORDER BY ts DESC, id DESC LIMIT n``
(``>`` and ascending for a list read oldest first): a range scan of an index
on ``(filter column, ts, id)`` that starts where the page before stopped,
however deep the client has paged (store/schema.py: ``*_page`` indexes).

Stable under inserts and deletes. A cursor is the last row's key, not a
position, so a row inserted or purged while a client pages moves no other
row across a page boundary. Every row committed before the first page is
read is seen exactly once; a row committed meanwhile is seen at most once
(in the page its key falls in, if that page is still to be read). A row's
timestamp is the database clock when its transaction wrote it (PostgreSQL:
the transaction's start), so a row may commit behind a page already read: a
walk is a consistent listing, not a gap-free feed of later commits.

The byte cap. A page ends before the row that would take the JSON of its
records past ``max_bytes`` (its first row always goes in: a row larger than
the cap is still readable, alone on its page). Rows past the cap are not
read: where rows stream (SQLite) the page reads them one at a time and
stops; where a result arrives whole (PostgreSQL) a first statement reads
the byte length of each candidate row's variable columns (``octet_length``:
a TOASTed value's length, without fetching the value) and the second reads
only the rows that fit. Either way each record is then measured as encoded.

The cursor. Opaque to clients: base64url of ``[list, ts, id]`` JSON. It
names its list, so one list's cursor given to another is refused; anything
that does not decode is :class:`InvalidCursor` (422), never a fault.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from ironflow.protocol import encoder
from ironflow.store.base import InvalidCursor
from ironflow.store.records import PageRequest
from ironflow.store.tx import Tx

T = TypeVar("T")

# Longest cursor accepted: ours are ~100 characters (a list name, a float and
# an id); a longer one is not ours, and is refused before it is decoded.
MAX_CURSOR_CHARS = 512

_cursor_decode = msgspec.json.Decoder(tuple[str, float, str]).decode


@dataclass(frozen=True)
class Keyset:
    """A list's order: its ``name`` (carried in its cursors), the timestamp
    and id columns of its key, and whether it reads newest first."""

    name: str
    ts: str
    id: str
    descending: bool


@dataclass(frozen=True)
class PageQuery(Generic[T]):
    """One list as SQL: the ``columns`` selected from ``source`` (a table and
    alias), ``filters`` (column → value, None: unfiltered; columns are ours,
    never input), the variable-size columns among the selected (``sized``,
    for the byte pre-pass), the row → record ``build`` and the record's ``key``."""

    keyset: Keyset
    columns: str
    source: str
    filters: dict[str, Any]
    sized: Sequence[str]
    build: Callable[[tuple[Any, ...]], T]
    key: Callable[[T], tuple[float, str]]


def encode_cursor(keyset: Keyset, ts: float, ident: str) -> str:
    """The opaque cursor of the page after the row keyed ``(ts, ident)``."""
    raw = encoder.encode([keyset.name, ts, ident])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(keyset: Keyset, cursor: str) -> tuple[float, str]:
    """The key a cursor of ``keyset``'s list stands for. InvalidCursor otherwise."""
    if len(cursor) > MAX_CURSOR_CHARS:
        raise InvalidCursor(f"cursor is longer than {MAX_CURSOR_CHARS} characters: not one this node issued")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        name, ts, ident = _cursor_decode(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        # ValueError: a non-ASCII cursor; msgspec errors are ValueErrors too.
        raise InvalidCursor(
            "cursor is malformed: pass back the next_cursor of the page before, unchanged"
        ) from None
    if name != keyset.name:
        raise InvalidCursor(f"cursor belongs to the {name!r} list, not to {keyset.name!r}")
    if not math.isfinite(ts):
        raise InvalidCursor("cursor is malformed: its timestamp is not a finite number")
    return ts, ident


def read_page(tx: Tx, query: PageQuery[T], page: PageRequest) -> tuple[list[T], str | None]:
    """One page of ``query`` in its order: its records and the cursor of the
    next page (None: nothing follows). InvalidCursor for a bad ``page.cursor``."""
    keyset = query.keyset
    conds = [f"{col} = ?" for col, value in query.filters.items() if value is not None]
    params: list[Any] = [value for value in query.filters.values() if value is not None]
    if page.cursor is not None:
        conds.append(f"({keyset.ts}, {keyset.id}) {'<' if keyset.descending else '>'} (?, ?)")
        params.extend(decode_cursor(keyset, page.cursor))
    where = f" WHERE {' AND '.join(conds)}" if conds else ""
    direction = " DESC" if keyset.descending else ""
    tail = f"{where} ORDER BY {keyset.ts}{direction}, {keyset.id}{direction} LIMIT ?"
    rows_sql = f"SELECT {query.columns} FROM {query.source}{tail}"
    if page.max_bytes is None or tx.streams_rows or not query.sized:
        # One more row than the page holds: whether another page follows.
        rows = tx.iterate(rows_sql, [*params, page.limit + 1])
        records, more = _fill(rows, page.limit, page.max_bytes, query.build)
    else:
        size = " + ".join(f"coalesce(octet_length({col}), 0)" for col in query.sized)
        sizes = [r[0] for r in tx.fetchall(f"SELECT {size} FROM {query.source}{tail}", [*params, page.limit + 1])]
        n = _fitting(sizes[: page.limit], page.max_bytes)
        records, capped = _fill(tx.fetchall(rows_sql, [*params, n]), n, page.max_bytes, query.build)
        more = capped or len(sizes) > n
    if not (more and records):
        return records, None
    return records, encode_cursor(keyset, *query.key(records[-1]))


def _fitting(sizes: list[int], max_bytes: int) -> int:
    """How many leading rows of these payload sizes fit in ``max_bytes`` (at least one)."""
    total = 0
    for n, size in enumerate(sizes):
        total += int(size)
        if n and total > max_bytes:
            return n
    return len(sizes)


def _fill(
    rows: Iterable[tuple[Any, ...]], limit: int, max_bytes: int | None,
    build: Callable[[tuple[Any, ...]], T],
) -> tuple[list[T], bool]:
    """Up to ``limit`` records of ``rows`` whose JSON stays within ``max_bytes``
    (the first always); True when a row was left for the next page."""
    records: list[T] = []
    total = 0
    for row in rows:
        if len(records) == limit:
            return records, True
        record = build(row)
        if max_bytes is not None:
            size = len(encoder.encode(record)) + 1  # and its comma in the list
            if records and total + size > max_bytes:
                return records, True
            total += size
        records.append(record)
    return records, False
