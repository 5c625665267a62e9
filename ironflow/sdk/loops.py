"""Which event loop runs the calling task: the few places the SDK must know.

Everything else in the SDK is written on AnyIO and does not ask. Trio is
looked for only if something already imported it, so an asyncio worker never
imports Trio (a light install need not have it).
"""

from __future__ import annotations

import sys


def current_loop() -> str:
    """``"trio"`` inside a Trio run, else ``"asyncio"`` (the SDK's two loops)."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return "trio"
    return "asyncio"
