"""Results of a group commit handed back to their Trio callers: one wake-up of
each caller's Trio thread per group, not one per call (both backends' writer
threads use it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import trio


def hand_back(done: Iterable[tuple[Any, Callable[[Any], None], Any]]) -> None:
    """Call every ``deliver(result)`` on its ``token``'s Trio thread: one
    ``run_sync_soon`` per token. ``done``: ``(token, deliver, result)``
    triples; a token whose run is over is skipped (nobody is waiting)."""
    by_token: dict[int, tuple[Any, list[tuple[Callable[[Any], None], Any]]]] = {}
    for token, deliver, result in done:
        by_token.setdefault(id(token), (token, []))[1].append((deliver, result))
    for token, deliveries in by_token.values():
        try:
            token.run_sync_soon(_deliver_all, deliveries)
        except trio.RunFinishedError:
            pass


def _deliver_all(deliveries: list[tuple[Callable[[Any], None], Any]]) -> None:
    for deliver, result in deliveries:
        deliver(result)
