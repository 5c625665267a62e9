"""A fix for hypercorn's Trio worker: close a connection the protocol closed.

hypercorn 0.18 (``trio/tcp_server.py``) closes an HTTP/1.1 connection after a
response to ``Connection: close`` or HTTP/1.0 by sending ``Closed`` from the
application's task. quart-trio cancels that task as the response ends, so the
``send_eof``/``aclose`` inside is cancelled at its first checkpoint and the
socket stays open until the *client* closes it: 200 such requests left 200
descriptors open on the node. The close is quick and must not be skipped, so
it is shielded here (bounded by a timeout). Same family as upstream
pgjones/hypercorn#106.
"""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.events import Closed
from hypercorn.trio.tcp_server import TCPServer

# Upper bound on the shielded close: send_eof and aclose do not block on a
# healthy socket; this only guards a wedged one.
CLOSE_TIMEOUT_S = 1.0

_original_protocol_send = TCPServer.protocol_send


async def _protocol_send(self: TCPServer, event: Any) -> None:
    if isinstance(event, Closed):
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            await _original_protocol_send(self, event)
        return
    await _original_protocol_send(self, event)


def apply() -> None:
    """Install the shielded close (idempotent)."""
    if TCPServer.protocol_send is not _protocol_send:
        TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
