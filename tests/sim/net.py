"""The simulated wire: one connection = two links of JSON text frames, with faults.

In place of a websocket, a :class:`Connection` joins a simulated worker to
the node's REAL socket bridge (``ironflow.api.worker_socket._serve_socket``)
through :class:`FakeWebSocket`, which offers the three calls the bridge makes
on a quart websocket (``receive``, ``send``, ``close``). Frames are the real
protocol messages, encoded and decoded by the real codecs.

Each link carries frames in order and applies the seed's per-frame faults
(:class:`~tests.sim.schedule.FrameFaults`):

- **delay**: the link stalls (later frames wait behind the delayed one);
- **duplicate**: a frame is delivered twice (never a Register);
- **reorder**: a frame is overtaken by the next one when that belongs to
  another run (frames of one run keep their order, as one websocket and the
  SDK's single outbox guarantee: a step result is never overtaken by its
  job's final result);
- **drop**: a single frame vanishes while the connection lives on, only where
  a timer of the protocol covers the loss (every engine → worker frame, and a
  worker's Heartbeat, JobAck or JobNack). A lost result frame is what it is
  over a websocket: the connection died with it (``conn_cut``, worker crash,
  node crash lose every frame in flight).

A worker's graceful close travels in band after its last frame; the bridge
is then cancelled as quart cancels a websocket handler whose client left.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from ironflow.protocol import (
    EngineMessage,
    Heartbeat,
    JobAck,
    JobNack,
    Register,
    encoder,
    engine_message_decoder,
    worker_message_decoder,
)

if TYPE_CHECKING:
    from tests.sim.schedule import FrameFaults

CLOSE = "\x00close"  # in-band close of a link (a websocket close frame)
# How long a frame picked to be reordered waits for one to overtake it.
REORDER_WAIT_S = 0.5


def _run_of(msg: Any) -> str | None:
    return getattr(msg, "run_id", None)


class Link:
    """One direction of one connection."""

    def __init__(
        self,
        name: str,
        rng: random.Random,
        faults: FrameFaults,
        counts: Counter[str],
        *,
        upstream: bool,
    ) -> None:
        self.name = name
        self.rng = rng
        self.faults = faults
        self.counts = counts
        self.upstream = upstream  # worker → engine
        self._in_send, self._in_recv = trio.open_memory_channel[tuple[Any, str]](math.inf)
        self.out_send, self.out_recv = trio.open_memory_channel[str](math.inf)
        self.delivered = 0

    def send(self, msg: Any) -> None:
        """Queue a message (never blocks; lost if the link is already gone)."""
        self.send_text(encoder.encode(msg).decode(), msg)

    def send_text(self, text: str, msg: Any = None) -> None:
        try:
            self._in_send.send_nowait((msg, text))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def close(self) -> None:
        """In-band close, after every frame queued before it."""
        self.send_text(CLOSE)

    def shut(self) -> None:
        """The link is gone (a cut): the receiving end sees the end of the stream."""
        self._in_send.close()
        self.out_send.close()

    def _decode(self, msg: Any, text: str) -> Any:
        if msg is not None or text == CLOSE:
            return msg
        decoder = worker_message_decoder if self.upstream else engine_message_decoder
        return decoder.decode(text)

    def _droppable(self, msg: Any) -> bool:
        if self.upstream:
            return isinstance(msg, Heartbeat | JobAck | JobNack)
        return True

    def _deliver(self, text: str) -> None:
        try:
            self.out_send.send_nowait(text)
            self.delivered += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def pump(self) -> None:
        """Move frames from sender to receiver, applying the faults, until shut."""
        async for msg, text in self._in_recv:
            if text == CLOSE:
                self._deliver(text)
                continue
            msg = self._decode(msg, text)
            f = self.faults  # healed at the end of the fault phase
            r = self.rng.random()
            if isinstance(msg, Register):
                self._deliver(text)
                continue
            if r < f.drop and self._droppable(msg):
                self.counts["frame_drop"] += 1
                continue
            r -= f.drop
            if r < f.delay:
                self.counts["frame_delay"] += 1
                await trio.sleep(round(self.rng.uniform(0.0, f.max_delay_s), 3))
                self._deliver(text)
                continue
            r -= f.delay
            if r < f.duplicate:
                self.counts["frame_duplicate"] += 1
                self._deliver(text)
                self._deliver(text)
                continue
            r -= f.duplicate
            if r < f.reorder:
                nxt: tuple[Any, str] | None = None
                with trio.move_on_after(REORDER_WAIT_S):
                    nxt = await self._in_recv.receive()
                if nxt is None:
                    self._deliver(text)
                    continue
                nmsg = self._decode(*nxt)
                if nxt[1] != CLOSE and not isinstance(nmsg, Register) and _run_of(nmsg) != _run_of(msg):
                    self.counts["frame_reorder"] += 1
                    self._deliver(nxt[1])
                    self._deliver(text)
                else:
                    self._deliver(text)
                    self._deliver(nxt[1])
                continue
            self._deliver(text)


class Connection:
    """A worker's websocket to one node incarnation."""

    def __init__(self, no: int, worker_name: str, up: Link, down: Link) -> None:
        self.no = no
        self.worker_name = worker_name
        self.up = up
        self.down = down
        self.scope = trio.CancelScope()  # cancelled: the connection is cut
        self.bridge_scope = trio.CancelScope()  # cancelled: quart ends the handler
        self.ws = FakeWebSocket(self)
        self.ended = trio.Event()
        self.close_code: int | None = None

    def cut(self) -> None:
        """Drop the connection at once: frames in flight are lost both ways."""
        self.scope.cancel()


class FakeWebSocket:
    """What ``_serve_socket`` needs of quart's websocket, over two links."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def receive(self) -> str:
        try:
            text = await self._conn.up.out_recv.receive()
        except trio.EndOfChannel:
            text = CLOSE
        if text == CLOSE:
            # The client closed: quart cancels the handler (the bridge's
            # shielded session still applies every frame already read).
            self._conn.bridge_scope.cancel()
            await trio.sleep_forever()
        return text

    async def send(self, text: str) -> None:
        self._conn.down.send_text(text)
        await trio.lowlevel.checkpoint()

    async def close(self, code: int, reason: str = "") -> None:
        if self._conn.close_code is None:
            self._conn.close_code = code
        self._conn.down.close()
        await trio.lowlevel.checkpoint()


def decode_engine(text: str) -> EngineMessage:
    message: EngineMessage = engine_message_decoder.decode(text)
    return message
