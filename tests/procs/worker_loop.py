"""The event loop a test worker process runs on, as a user would start it.

``IRONFLOW_WORKER_LOOP`` (``asyncio`` | ``trio``; default ``asyncio``, the
loop most users meet): the worker's ``main`` runs under ``asyncio.run`` or
``trio.run`` itself, not through a shim, so a process test proves the SDK
under the very call a user writes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

LOOP_ENV = "IRONFLOW_WORKER_LOOP"
LOOPS = ("asyncio", "trio")


def loop_name() -> str:
    """The loop this process runs its worker on (``LOOP_ENV``); ValueError if unknown."""
    name = os.environ.get(LOOP_ENV, "asyncio")
    if name not in LOOPS:
        raise ValueError(f"{LOOP_ENV} must be one of {', '.join(LOOPS)}, got {name!r}")
    return name


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main()`` to completion on the selected loop (named on stderr first,
    so a test can check which loop its worker ran on)."""
    name = loop_name()
    print(f"worker loop: {name}", file=sys.stderr, flush=True)
    if name == "trio":
        import trio

        trio.run(main)
    else:
        import asyncio

        asyncio.run(main())  # type: ignore[arg-type]


def serve(worker: Any, *, wait_for: Path | None = None) -> None:
    """Run ``worker`` (a ``StreamingWorker`` or ``PullWorker``) on the selected
    loop until it stops, printing ``READY <pid>`` once it is connected: the line
    the tests' ``Proc.wait_line("READY")`` waits for. ``wait_for``: a file whose
    creation starts the worker (a test holds it back until its nodes are up)."""

    async def main() -> None:
        import anyio

        while wait_for is not None and not wait_for.exists():
            await anyio.sleep(0.02)
        async with anyio.create_task_group() as nursery:
            await nursery.start(worker.run)
            print(f"READY {os.getpid()}", flush=True)

    run(main)
