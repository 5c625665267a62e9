"""A TCP proxy that can be switched to a blackhole: what a network partition
looks like to both ends.

``BlackholeProxy(host, port)`` listens on a free loopback port and forwards
every connection made to it to ``host:port``. :meth:`BlackholeProxy.blackhole`
holds every byte in both directions, on every connection, old and new,
without closing anything: each end's writes are taken by its kernel and go
nowhere, no reset, no end of file (a connection closed meanwhile by either end
is not seen by the other either). :meth:`BlackholeProxy.heal` lets everything
held through, in order, and forwarding goes on as before.

One thread of its own (a selector loop), so it serves a node in the test's
Trio run, its database threads or another process alike.
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType

# Bytes read from one socket at a time.
_CHUNK = 65536


class _Side:
    """One socket of a proxied connection and the bytes waiting to be written to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()
        self.peer: _Side | None = None
        self.eof_seen = False  # read end of file: the peer is shut down once ``out`` is flushed
        self.closed = False


class BlackholeProxy:
    """A forwarding proxy on 127.0.0.1 that :meth:`blackhole` silences (see the
    module docstring). A context manager: ``with BlackholeProxy(h, p) as proxy``."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._holding = False
        self._stop = False
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sides: list[_Side] = []
        self.error: BaseException | None = None  # what ended the thread, if not close()
        self._thread = threading.Thread(target=self._loop, name="blackhole-proxy", daemon=True)
        self._thread.start()

    # ── control ─────────────────────────────────────────────────────────────

    def url(self, url: str) -> str:
        """``url`` (``scheme://user@host:port/db``) pointed at this proxy instead."""
        scheme, rest = url.split("://", 1)
        user, _, hostpart = rest.rpartition("@")
        tail = hostpart.split("/", 1)[1] if "/" in hostpart else ""
        return f"{scheme}://{user + '@' if user else ''}127.0.0.1:{self.port}/{tail}"

    def blackhole(self) -> None:
        """Hold every byte from now on, in both directions; close nothing."""
        self._set(holding=True)

    def heal(self) -> None:
        """Let everything held through and forward again."""
        self._set(holding=False)

    def close(self) -> None:
        """Stop the proxy and close every connection through it; raise what
        broke its thread, if anything did."""
        if self._thread.is_alive():
            self._set(stop=True)
            self._thread.join(timeout=5)
        self._wake_w.close()
        if self.error is not None:
            raise RuntimeError("the blackhole proxy's thread failed") from self.error

    def __enter__(self) -> BlackholeProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _set(self, *, holding: bool | None = None, stop: bool = False) -> None:
        with self._lock:
            if holding is not None:
                self._holding = holding
            self._stop = self._stop or stop
        self._wake_w.send(b"x")

    # ── the loop ────────────────────────────────────────────────────────────

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    holding, stop = self._holding, self._stop
                if stop:
                    return
                self._sides = [s for s in self._sides if not s.closed]
                # A new selector each turn: what to wait for changes with every
                # byte moved, and a socket closed meanwhile leaves no stale entry.
                with selectors.DefaultSelector() as sel:
                    self._turn(sel, holding)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            for side in self._sides:
                side.sock.close()
            self._listener.close()
            self._wake_r.close()

    def _turn(self, sel: selectors.BaseSelector, holding: bool) -> None:
        """Wait once for something to do, and do it."""
        sel.register(self._wake_r, selectors.EVENT_READ)
        sel.register(self._listener, selectors.EVENT_READ)
        if not holding:  # held: nothing read, nothing written
            for side in self._sides:
                events = 0 if side.eof_seen else selectors.EVENT_READ
                if side.out:
                    events |= selectors.EVENT_WRITE
                if events:
                    sel.register(side.sock, events, side)
        for key, mask in sel.select():
            if key.fileobj is self._wake_r:
                self._wake_r.recv(4096)
            elif key.fileobj is self._listener:
                self._accept()
            elif not self._holding and not key.data.closed:  # held since the select began, or gone
                self._pump(key.data, mask)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        upstream = socket.create_connection(self.target)
        a, b = _Side(client), _Side(upstream)
        a.peer, b.peer = b, a
        for side in (a, b):
            side.sock.setblocking(False)
            self._sides.append(side)

    def _pump(self, side: _Side, mask: int) -> None:
        peer = side.peer
        assert peer is not None
        if mask & selectors.EVENT_READ:
            try:
                data = side.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                side.eof_seen = True
                if not peer.out:
                    self._shut(peer)
            elif data:
                peer.out += data
        if mask & selectors.EVENT_WRITE and side.out:
            try:
                sent = side.sock.send(side.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close_pair(side)
                return
            del side.out[:sent]
            if not side.out and peer.eof_seen:
                self._shut(side)
        if side.eof_seen and peer.eof_seen and not side.out and not peer.out:
            self._close_pair(side)

    @staticmethod
    def _shut(side: _Side) -> None:
        try:
            side.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _close_pair(side: _Side) -> None:
        for s in (side, side.peer):
            if s is not None and not s.closed:
                s.closed = True
                s.sock.close()
