"""Time-sortable identifiers: ``<prefix>_<16 hex of time_ns><16 hex random>``.

Sorting ids as strings sorts them by creation time (to the nanosecond on one
host), which keeps index inserts append-mostly and listings readable.
"""

from __future__ import annotations

import os
import time

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    """Return a fresh id such as ``run_0017f3c2a1b4c5d6e0a1b2c3d4e5f607``.

    ``prefix`` names the kind of object (``run``, ``evt``, ``ses``, ``key``…).
    """
    return f"{prefix}_{time.time_ns():016x}{os.urandom(8).hex()}"
