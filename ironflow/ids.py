"""Time-sortable identifiers: ``<prefix>_<16 hex of time_ns><16 hex random>``.

Sorting ids as strings sorts them by creation time (to the nanosecond on one
host), which keeps index inserts append-mostly and listings readable.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["default_node_id", "ids_from", "new_id"]

# Set by ``ids_from`` (the deterministic simulator): where new ids come from.
_source: Callable[[str], str] | None = None


def new_id(prefix: str) -> str:
    """Return a fresh id such as ``run_0017f3c2a1b4c5d6e0a1b2c3d4e5f607``.

    ``prefix`` names the kind of object (``run``, ``evt``, ``ses``, ``key``…).
    """
    if _source is not None:
        return _source(prefix)
    return f"{prefix}_{time.time_ns():016x}{os.urandom(8).hex()}"


def default_node_id() -> str:
    """A node id for a node started without one: the host name and a random suffix."""
    return f"{socket.gethostname()}-{new_id('node')[-8:]}"


@contextmanager
def ids_from(source: Callable[[str], str]) -> Iterator[None]:
    """Within the block, every :func:`new_id` is ``source(prefix)``.

    For the deterministic simulator (``tests/sim``): ids drawn from a seeded
    source make a replayed seed produce the very same ids. ``source`` must keep
    ids time-sortable, i.e. increasing in creation order.
    """
    global _source
    previous, _source = _source, source
    try:
        yield
    finally:
        _source = previous
