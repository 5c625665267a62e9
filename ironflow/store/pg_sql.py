"""PostgreSQL statement text: the store's ``?`` placeholders rewritten for
psycopg (``%s``) and for libpq (``$1, $2, …``), leaving alone every ``?``
that is not a placeholder (a literal, a quoted identifier, a dollar-quoted
body, a comment, the jsonb ``?``, ``?|`` and ``?&`` operators)."""

from __future__ import annotations

from collections.abc import Callable

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
