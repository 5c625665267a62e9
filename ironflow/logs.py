"""Structured logging: one event per line, ``message key=value ...``.

The seed's log lines (``capacity: job nacked, re-queued with no attempt used``)
appear verbatim as the message; run id, execution_seq and session id travel as
fields so a reader can grep either.

Values come from workers and callers (a ``worker_id``, an event name), so a
line can never be forged: control characters are escaped and a value holding
a space, a quote or ``=`` is quoted (logfmt), so one event is one line and
every ``key=`` on it was put there by the node.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: each
# could end a line (or rewrite it) in a terminal or a log shipper.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A value needing quotes: it could otherwise read as more than one field.
_NEEDS_QUOTES = re.compile(r'[\s"=\\]')


def _escape_control(text: str) -> str:
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _value(value: Any) -> str:
    """One field value, safe to put on a ``key=value`` line."""
    text = str(value)
    if text and not _NEEDS_QUOTES.search(text) and not _CONTROL.search(text):
        return text
    return '"' + _escape_control(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        # The message with its arguments is escaped too; a traceback appended
        # below keeps its own newlines (the node wrote it, not a caller).
        line = self.formatMessage(self._prepared(record))
        fields: dict[str, Any] = getattr(record, "fields", None) or {}
        if fields:
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line

    def _prepared(self, record: logging.LogRecord) -> logging.LogRecord:
        record.message = _escape_control(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        return record


def formatter() -> logging.Formatter:
    """The ``time LEVEL logger: message key=value ...`` formatter the node and workers share."""
    return _KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def setup(level: str = "INFO") -> None:
    """Send every ``ironflow`` log line to stderr in key=value form."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter())
    root = logging.getLogger("ironflow")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(
    logger: logging.Logger,
    level: int,
    message: str,
    *,
    exc_info: BaseException | None = None,
    **fields: Any,
) -> None:
    """Log ``message`` with structured ``fields`` (``None`` values are dropped)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, exc_info=exc_info, extra=log_fields(**fields))


def log_fields(**fields: Any) -> dict[str, Any]:
    """The ``extra=`` of a stdlib logging call whose line carries ``fields`` as
    ``key=value`` (``None`` values dropped): what :func:`event` passes, for a
    caller that logs with ``logger.info(...)`` itself (the worker SDK)."""
    return {"fields": {k: v for k, v in fields.items() if v is not None}}
