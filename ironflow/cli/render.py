"""Output for people: aligned tables, one-line JSON cells, spans and countdowns.

Outputs and event data are shown in full with ``--json``; here they are cut
to keep each row on one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
import msgspec

# A table cell longer than this is cut with "…" so a row stays on one screen line.
CELL_MAX = 60


def echo_json(content: bytes) -> None:
    """Print the API's JSON answer, indented, keys in the API's order."""
    click.echo(json.dumps(json.loads(content), indent=2, ensure_ascii=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, empty: str) -> None:
    """Print rows under headers with aligned columns (the last column is not padded).

    ``None`` cells show as ``-``; no rows prints ``empty`` instead.
    """
    if not rows:
        click.echo(empty)
        return
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        click.echo("  ".join(padded).rstrip())


def next_page(cursor: str | None, command: str) -> None:
    """After a page that is not the last: how to read the next one."""
    if cursor is not None:
        click.echo(f"more: {command} --cursor {cursor}")


def fields(pairs: Sequence[tuple[str, Any]]) -> None:
    """Print ``name  value`` lines with the names aligned (``None`` shows as ``-``)."""
    width = max(len(name) for name, _ in pairs)
    for name, value in pairs:
        click.echo(f"{name.ljust(width)}  {'-' if value is None else value}")


def compact(value: Any, limit: int = CELL_MAX) -> str:
    """One-line JSON of ``value`` (strings as they are), cut to ``limit`` characters."""
    if value is None:
        return "-"
    text = (
        value
        if isinstance(value, str)
        else json.dumps(msgspec.to_builtins(value), separators=(",", ":"), ensure_ascii=False)
    )
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def span(seconds: float) -> str:
    """A short human span: 0.4s, 12.3s, 4m, 2h, 3d."""
    seconds = abs(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def ago(ts: float | None, now: float) -> str:
    """``3s ago`` for a past epoch timestamp, ``in 3s`` for a future one."""
    if ts is None:
        return "-"
    delta = now - ts
    if -0.05 < delta < 1:
        return "just now"
    return f"{span(delta)} ago" if delta > 0 else f"in {span(delta)}"


def countdown(seconds: float | None, *, past: str = "now") -> str:
    """``in 12.3s`` for a positive count of seconds; ``past`` otherwise."""
    if seconds is None:
        return "-"
    if seconds <= 0:
        return past
    return f"in {seconds:.1f}s" if seconds < 60 else f"in {span(seconds)}"


def ms(value: float | None) -> str:
    """Milliseconds: one decimal below 10 ms, whole above."""
    if value is None:
        return "-"
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def duration_ms(start: float | None, end: float | None) -> str:
    """The span between two epoch timestamps in milliseconds; ``-`` if either is missing."""
    if start is None or end is None:
        return "-"
    return ms((end - start) * 1000.0)
