"""How the PostgreSQL store's statements reach the server: :class:`PgTx`.

Two forms of one thing, chosen per class by :attr:`PgTx.libpq_fast_path`:

- **the libpq fast path** (the default): a statement goes straight to libpq
  (``PQexecPrepared`` on a statement prepared once per connection, text
  parameters, rows loaded by psycopg's own loaders), since a psycopg cursor
  costs about twice the client CPU per statement. It leans on psycopg's
  lower layer (``Connection.pgconn``, ``Transformer``,
  ``errors.error_from_result``) and on a ``?`` → ``$n`` rewrite of our own
  (:func:`numbered`, the lexer below).
- **psycopg's own prepared statements**: every statement through a psycopg
  cursor (``prepare=True``, ``?`` → ``%s``). Used for a parameter of another
  type than str/int/float/bool/None, and for every statement when
  :func:`fast_path_refusal` finds psycopg's lower layer not the one the fast
  path was written for (the store then logs why once it opens).

Same statements, same rows, same errors either way
(``tests/store/test_pg_tx_forms.py`` runs both).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer

from ironflow.store.core import lock_id

# ── the ``?`` placeholders ─────────────────────────────────────────────────

_sql_cache: dict[str, str] = {}


def pg_sql(sql: str) -> str:
    """``?`` placeholders → psycopg's ``%s`` (every literal ``%`` escaped), memoised."""
    out = _sql_cache.get(sql)
    if out is None:
        out = _sql_cache[sql] = _rewrite(sql.replace("%", "%%"), lambda _: "%s")
    return out


# Words after which a ``?`` is a value (a placeholder), although a word before
# a ``?`` otherwise makes it the jsonb operator (``data ? 'key'``).
_VALUE_AFTER = frozenset(
    "select limit offset then else when and or not in is like by set where on as values"
    " returning distinct case between".split()
)


def _placeholders(sql: str) -> list[int]:
    """Offsets of the ``?`` placeholders of ``sql``: not those inside a string
    literal, a quoted identifier, a dollar-quoted body or a comment, nor the
    jsonb operators ``?``, ``?|`` and ``?&`` (a ``?`` right after an operand:
    a name that is not a keyword, a closing bracket, a literal)."""
    found: list[int] = []
    i, n = 0, len(sql)
    last = ""  # the last significant token before i: a word, or one character
    while i < n:
        c = sql[i]
        if c in "'\"":
            end = i + 1
            while end < n:
                if sql[end] == c:
                    if end + 1 < n and sql[end + 1] == c:  # '' or "" inside
                        end += 2
                        continue
                    break
                end += 1
            i, last = end + 1, "literal"
            continue
        if c == "-" and sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        if c == "/" and sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = n if end < 0 else end + 2
            continue
        if c == "$":
            tag_end = sql.find("$", i + 1)
            tag = sql[i : tag_end + 1] if tag_end > 0 else ""
            if tag and (tag == "$$" or tag[1:-1].replace("_", "a").isalnum() and not tag[1].isdigit()):
                end = sql.find(tag, tag_end + 1)
                i, last = (n if end < 0 else end + len(tag)), "literal"
                continue
        if c.isalnum() or c == "_":
            end = i
            while end < n and (sql[end].isalnum() or sql[end] == "_"):
                end += 1
            last, i = sql[i:end].lower(), end
            continue
        if c == "?":
            operand = last in ("literal", ")", "]") or (
                last[:1].isalnum() or last[:1] == "_"
            ) and last not in _VALUE_AFTER
            if not operand and sql[i + 1 : i + 2] not in ("|", "&"):
                found.append(i)
            last, i = "?", i + 1
            continue
        if not c.isspace():
            last = c
        i += 1
    return found


def _rewrite(sql: str, mark: Callable[[int], str]) -> str:
    """``sql`` with its n-th placeholder (from 1) replaced by ``mark(n)``."""
    out: list[str] = []
    start = 0
    for number, at in enumerate(_placeholders(sql), start=1):
        out.append(sql[start:at])
        out.append(mark(number))
        start = at + 1
    out.append(sql[start:])
    return "".join(out)



_numbered_cache: dict[str, bytes] = {}


def numbered(sql: str) -> bytes:
    """``?`` placeholders → libpq's ``$1, $2, …`` (see :func:`_placeholders`), memoised."""
    out = _numbered_cache.get(sql)
    if out is None:
        out = _numbered_cache[sql] = _rewrite(sql, lambda n: f"${n}").encode()
    return out


class _Locking(Protocol):
    """A call of a group: the named locks it asked for (``(name, exclusive)``)."""

    locks: Sequence[tuple[str, bool]]


# The psycopg releases whose lower layer the fast path was written against
# (major, minor); pyproject allows exactly these.
WRITTEN_FOR_PSYCOPG = ((3, 2), (3, 3))


def fast_path_refusal() -> str | None:
    """Why the libpq fast path is not used with the installed psycopg, or None."""
    found = tuple(int(part) for part in psycopg.__version__.split(".")[:2])
    if found not in WRITTEN_FOR_PSYCOPG:
        return f"psycopg {psycopg.__version__} is installed; the libpq fast path was written for 3.2 and 3.3"
    missing = [
        name for owner, name in (
            (pq.abc.PGconn, "exec_prepared"), (pq.abc.PGconn, "prepare"), (pq.abc.PGconn, "exec_params"),
            (Transformer, "set_pgresult"), (Transformer, "load_rows"), (psycopg.errors, "error_from_result"),
        )
        if not hasattr(owner, name)
    ]
    if missing:
        return f"psycopg {psycopg.__version__} lacks {', '.join(missing)}"
    return None


# Server-side prepared statements per connection: above the number of distinct
# statements the store issues; beyond it a statement runs unprepared.
PREPARED_MAX = 512
# A statement whose best plan may depend on a parameter's value — a range
# (``<``, ``>``, ``<=``, ``>=`` against one) or a ``LIMIT`` — is planned
# with its values at every execution (libpq's unnamed statement); every
# other statement is prepared and planned once, generically (the actors'
# connections run with ``plan_cache_mode = force_generic_plan``, see
# ``_Actor._connect``).
_VALUE_PLANNED = re.compile(r"(?:(?<!<)[<>]=?\s*\?)|(?:\?\s*[<>])|(?:LIMIT\s+\?)|(?:OFFSET\s+\?)", re.IGNORECASE)
# Parameter type OIDs sent with the text-format values (0: let the server infer).
_OID_UNKNOWN, _OID_BOOL, _OID_INT8, _OID_FLOAT8 = 0, 16, 20, 701
_INT8_MIN, _INT8_MAX = -(2**63), 2**63 - 1
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


def _text_params(params: Sequence[Any]) -> tuple[list[bytes | None], tuple[int, ...]] | None:
    """Parameters as libpq text values and type OIDs; ``None`` for a type only
    psycopg's adapters know (then the statement goes through a cursor)."""
    values: list[bytes | None] = []
    oids: list[int] = []
    for v in params:
        t = type(v)
        if v is None:
            values.append(None)
            oids.append(_OID_UNKNOWN)
        elif t is str:
            values.append(v.encode())
            oids.append(_OID_UNKNOWN)  # as psycopg sends str: the server infers
        elif t is int and _INT8_MIN <= v <= _INT8_MAX:
            values.append(str(v).encode())
            oids.append(_OID_INT8)
        elif t is float and math.isfinite(v):
            values.append(repr(v).encode())
            oids.append(_OID_FLOAT8)
        elif t is bool:
            values.append(b"t" if v else b"f")
            oids.append(_OID_BOOL)
        else:
            return None
    return values, tuple(oids)


class PgTx:
    """:class:`~ironflow.store.core.Tx` over an actor's connection inside a group transaction.

    Statements take the libpq fast path or psycopg's cursor (the module
    docstring says when); ``prepared`` maps ``(sql, oids)`` to the fast path's
    statement names on this connection (the caller keeps it per connection).
    """

    modifying_with = True
    round_trips = True
    notifies_nodes = True
    streams_rows = False
    # Whether statements go straight to libpq; False: every statement through
    # psycopg's cursor, prepared by psycopg. Per class, so the store (a refused
    # psycopg) or a test subclass picks the form.
    libpq_fast_path: bool = fast_path_refusal() is None

    def __init__(self, conn: psycopg.Connection[Any], prepared: dict[Any, bytes]) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self._loader = Transformer(conn)
        self._prepared = prepared  # (sql, oids) → statement name, for this connection
        self._cur = conn.cursor()
        self._rows: list[tuple[Any, ...]] = []
        # Set by a call that wants the dispatcher kick; read once the call succeeded.
        self.notify_wanted = False
        # Runs the current call ended; announced to every node at commit.
        self.ended: list[str] = []

    def _run(self, sql: str, params: Sequence[Any]) -> int:
        """Run one statement; keep its rows for fetch*; return its row count."""
        adapted = _text_params(params) if self.libpq_fast_path else None
        if adapted is None:
            self._cur.execute(pg_sql(sql), params, prepare=not _VALUE_PLANNED.search(sql))
            self._rows = self._cur.fetchall() if self._cur.description is not None else []
            return self._cur.rowcount
        values, oids = adapted
        key = (sql, oids)
        name = self._prepared.get(key)
        if name is None:
            if len(self._prepared) >= PREPARED_MAX:
                return self._check(self._pgconn.exec_params(numbered(sql), values, oids))
            # b"": planned with its values each time (never prepared).
            name = b"" if _VALUE_PLANNED.search(sql) else f"ironflow_{len(self._prepared)}".encode()
            if name:
                self._check(self._pgconn.prepare(name, numbered(sql), oids))
            self._prepared[key] = name
        if not name:
            return self._check(self._pgconn.exec_params(numbered(sql), values, oids))
        # libpq takes None as NULL (psycopg's own calls pass it); its stub says bytes only.
        return self._check(self._pgconn.exec_prepared(name, values))  # type: ignore[arg-type]

    def _check(self, res: pq.abc.PGresult) -> int:
        if res.status not in _OK:
            raise psycopg.errors.error_from_result(res, encoding=self._conn.info.encoding)
        if res.status == pq.ExecStatus.TUPLES_OK:
            self._loader.set_pgresult(res)
            self._rows = self._loader.load_rows(0, res.ntuples, tuple)
        else:
            self._rows = []
        return res.command_tuples or 0

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._run(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._cur.executemany(pg_sql(sql), list(rows))

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        self._run(sql, params)
        return self._rows[0] if self._rows else None

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._run(sql, params)
        return self._rows

    def iterate(self, sql: str, params: Sequence[Any] = ()) -> Iterator[tuple[Any, ...]]:
        return iter(self.fetchall(sql, params))  # libpq loads the result whole

    def lock(self, of: str | None = None) -> str:
        return f"FOR UPDATE OF {of} SKIP LOCKED" if of else "FOR UPDATE SKIP LOCKED"

    def lock_wait(self) -> str:
        return "FOR UPDATE"

    def share_lock(self, of: str) -> str:
        return f"FOR SHARE OF {of}"

    def key_share_lock(self, of: str) -> str:
        return f"FOR KEY SHARE OF {of}"

    def renew_lock(self, of: str) -> str:
        return f"FOR NO KEY UPDATE OF {of} SKIP LOCKED"

    xid_sql = "pg_current_xact_id()::text::bigint"
    snapshot_sql = "pg_current_snapshot()::text"

    def notify(self) -> None:
        # One pg_notify per group, sent before COMMIT (see _commit).
        self.notify_wanted = True

    def take_notify(self) -> bool:
        wanted, self.notify_wanted = self.notify_wanted, False
        return wanted

    def runs_ended(self, run_ids: list[str]) -> None:
        self.ended.extend(run_ids)

    def advisory_lock(self, key: str) -> None:
        self._run("SELECT pg_advisory_xact_lock(hashtext(?))", (key,))

    def try_advisory_lock(self, key: str) -> bool:
        row = self.fetchone("SELECT pg_try_advisory_xact_lock(hashtext(?))", (key,))
        return bool(row and row[0])

    def raw(self, sql: str) -> None:
        """Statements of the actor's own (BEGIN, SAVEPOINT, COMMIT…; several
        joined by ``;``), no parameters: one simple query either way."""
        if self.libpq_fast_path:
            self._check(self._pgconn.exec_(sql.encode()))
        else:
            self._cur.execute(sql, prepare=False)

    def commit(self, statements: list[str]) -> None:
        """The group's closing statements — its NOTIFYs, COMMIT, perhaps the
        next BEGIN (see ``_commit``) — as one simple query."""
        self.raw("; ".join(statements))

    def begin(self, batch: Sequence[_Locking]) -> None:
        """BEGIN, then every named lock the group's calls asked for: sorted by
        lock number, each in the strongest mode any call wants (exclusive over
        shared), all in the same round trip. One global order for every group of
        every node: a group waits for a lock only while holding smaller ones, so
        no two groups wait for each other on them (the deadlocks of docs/isolation.md's
        race 6, where each call took its idempotency lock when it ran).

        A transaction the last group's COMMIT already began is
        used as it is: a group without named locks then costs no round trip
        here."""
        wanted: dict[int, bool] = {}
        for req in batch:
            for name, exclusive in req.locks:
                number = lock_id(name)
                wanted[number] = wanted.get(number, False) or exclusive
        statements = [] if in_transaction(self._pgconn) else ["BEGIN"]
        statements += [
            f"SELECT pg_advisory_xact_lock{'' if exclusive else '_shared'}({number})"
            for number, exclusive in sorted(wanted.items())
        ]
        if statements:
            self.raw("; ".join(statements))


def in_transaction(pgconn: pq.abc.PGconn) -> bool:
    """Whether a transaction is open on ``pgconn`` and usable (a group's
    COMMIT may have begun the next one: ``_commit``)."""
    return pgconn.transaction_status == pq.TransactionStatus.INTRANS
