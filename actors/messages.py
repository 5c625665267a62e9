"""Messages actors send each other over memory channels (small, immutable)."""

from __future__ import annotations

import msgspec
import trio


class Kick(msgspec.Struct, frozen=True):
    """Work may have become runnable (event ingested, slot freed, recovery, nack)."""

    why: str = ""


def kick(channel: trio.MemorySendChannel[Kick], why: str = "") -> None:
    """Wake the dispatcher without ever blocking the caller.

    Kicks coalesce: when the channel is full a round is already pending, so
    dropping this one loses nothing.
    """
    try:
        channel.send_nowait(Kick(why))
    except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
        pass
