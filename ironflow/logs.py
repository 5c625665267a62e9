"""Structured logging: one event per line, ``message key=value ...``.

The seed's log lines (``capacity: job nacked, re-queued with no attempt used``)
appear verbatim as the message; run id, execution_seq and session id travel as
fields so a reader can grep either.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields: dict[str, Any] = getattr(record, "fields", None) or {}
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return base


def setup(level: str = "INFO") -> None:
    """Send every ``ironflow`` log line to stderr in key=value form."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger("ironflow")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    """Log ``message`` with structured ``fields`` (``None`` values are dropped)."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"fields": {k: v for k, v in fields.items() if v is not None}})
