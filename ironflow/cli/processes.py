"""``ironflow serve --processes N``: N node processes on one port and one PostgreSQL.

Nodes keep no state of their own (they coordinate only through the
database), so a machine with more cores runs more node processes. The parent
started by ``ironflow serve --processes N`` serves nothing itself:

- It binds one listening socket per child on the port, each with
  ``SO_REUSEPORT``: the kernel spreads new connections over the children by
  a hash of each connection's addresses, and a socket only joins once its
  child listens (serves), and leaves when it exits. It then starts each child
  (``python -m ironflow.cli.processes``) with its socket, a control socket
  and the parent's own :class:`~ironflow.config.NodeConfig` (over stdin), the
  node id ``<id>-<i>``.
- SIGTERM and SIGINT are forwarded to every child: the first drains each
  (the graceful-drain seed, per process), a second stops each at once. The
  children run in their own process group, so Ctrl-C in a terminal reaches
  each once, through the parent. The parent exits once every child has
  exited: 0 if each exited 0.
- A child that exits before it served (its database unreachable or
  read-only, a port it cannot listen on) stops the group: its siblings are
  drained and the parent exits with the child's code. Restarting it would
  only fail again.
- A child that dies after serving (``kill -9``, the OOM killer, a crash) is
  started again, same node id, after :data:`RESTART_DELAY_S`, with a warning
  naming it and its exit. Meanwhile its workers reconnect and land on a
  sibling, and its leases are recovered like any lost node's. A restart that
  then fails to serve stops the group (no crash loop).
- A child whose parent died (``kill -9`` of the parent) reads end of file on
  its control socket and drains (``ironflow/node.py``).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import click
import msgspec
import trio

from ironflow.cli.errors import EXIT_FAILURE, CliFailure
from ironflow.config import NodeConfig

# Between a served child's death and its restart: long enough that a child
# killed again at once (the OOM killer on a full machine) costs a start per
# second rather than a spinning loop, short enough that its share of new
# connections is back before a worker's reconnect backoff grows.
RESTART_DELAY_S = 1.0
# The signals forwarded to the children (a deploy's SIGTERM, a terminal's Ctrl-C).
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def member_ids(base: str, count: int) -> list[str]:
    """The node ids of a group's children: ``<base>-1`` … ``<base>-<count>``."""
    return [f"{base}-{i}" for i in range(1, count + 1)]


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``, not yet listening.

    Its child listens on it (hypercorn's ``fd://`` bind); until then the
    kernel sends it no connections.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _say(line: str) -> None:
    click.echo(f"ironflow: {line}", err=True)


class _Group:
    """The parent's state: the children, whether the group is stopping, its exit code."""

    def __init__(self, config: NodeConfig, ids: list[str], port: int) -> None:
        self.config = config
        self.ids = ids
        self.port = port
        self.children: dict[str, trio.Process] = {}
        self.stopping = False
        self.exit_code = 0
        self.served: set[str] = set()

    def forward(self, signum: int) -> None:
        """Send ``signum`` to every running child; no child is restarted after this."""
        self.stopping = True
        for proc in self.children.values():
            if proc.returncode is None:
                proc.send_signal(signum)

    async def forward_signals(self, signals: AsyncIterator[int]) -> None:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                _say(f"{name}: draining {len(self.children)} node processes")
            else:
                _say(f"{name} again: stopping the node processes now")
            self.forward(signum)

    async def run_member(self, node_id: str, sock: socket.socket) -> None:
        """Run one child; start it again if it dies after serving (module docstring)."""
        listener: socket.socket | None = sock
        while True:
            if listener is None:
                try:
                    listener = bind_listener(self.config.host, self.port)
                except OSError as exc:
                    self.fail(f"cannot bind port {self.port} again for {node_id}: {exc}")
                    return
            code, served = await self._run_child(node_id, listener)
            listener = None
            if self.stopping:
                # Ended by a forwarded signal before (or after) its own handler: a stop, as asked.
                if code != 0 and -code not in FORWARDED:
                    _say(f"node process {node_id} ended with {_exit_text(code)}")
                    self.exit_code = self.exit_code or EXIT_FAILURE
                return
            if not served:
                self.fail(
                    f"node process {node_id} ended with {_exit_text(code)} before it served;"
                    " stopping the group",
                    code if code > 0 else EXIT_FAILURE,
                )
                return
            _say(
                f"node process {node_id} died after serving ({_exit_text(code)}); starting it"
                f" again in {RESTART_DELAY_S:g} s (its workers reconnect to a sibling)"
            )
            await trio.sleep(RESTART_DELAY_S)
            if self.stopping:
                return

    def fail(self, message: str, code: int = EXIT_FAILURE) -> None:
        """Stop the group (drain every child) and remember why and with which code."""
        _say(message)
        if not self.exit_code:
            self.exit_code = code
        if not self.stopping:
            self.forward(signal.SIGTERM)

    async def _run_child(self, node_id: str, listener: socket.socket) -> tuple[int, bool]:
        """Start one child on ``listener``; returns its exit code and whether it served."""
        parent_end, child_end = socket.socketpair()
        control = trio.socket.from_stdlib_socket(parent_end)
        fds = (listener.fileno(), child_end.fileno())
        try:
            try:
                proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "ironflow.cli.processes", *map(str, fds)],
                    stdin=subprocess.PIPE,
                    pass_fds=fds,
                    # Own process group: a terminal's Ctrl-C reaches the child once, forwarded.
                    process_group=0,
                )
            finally:
                # The child holds them now: its socket leaves the port when it exits.
                listener.close()
                child_end.close()
            self.children[node_id] = proc
            if self.stopping:
                proc.send_signal(signal.SIGTERM)
            served = False
            assert proc.stdin is not None
            try:  # a few hundred bytes: the pipe's buffer takes them at once
                await proc.stdin.send_all(msgspec.json.encode(_member_config(self.config, node_id)))
                await proc.stdin.aclose()
            except trio.BrokenResourceError:
                pass  # it died first: its exit code says why
            # The first bytes from the child say it serves; end of file, that it exited.
            if await control.recv(64):
                served = True
                self._note_served(node_id)
            code = await proc.wait()
        finally:
            control.close()
        return code, served

    def _note_served(self, node_id: str) -> None:
        first = node_id not in self.served
        self.served.add(node_id)
        if not first:
            _say(f"node process {node_id} serves again")
        elif len(self.served) == len(self.ids):
            _say(
                f"{len(self.ids)} node processes serving on port {self.port}"
                f" (node ids {', '.join(self.ids)}); Ctrl-C drains them all"
            )


def _member_config(config: NodeConfig, node_id: str) -> NodeConfig:
    return msgspec.structs.replace(config, node_id=node_id)


def bind_group(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets from :func:`bind_listener` on one port (port 0: one picked for all).

    A bind error is a :class:`CliFailure` naming the address.
    """
    try:
        sockets = [bind_listener(host, port)]
    except OSError as exc:
        raise CliFailure(f"cannot bind {host}:{port}: {exc}") from exc
    port = int(sockets[0].getsockname()[1])
    try:
        sockets += [bind_listener(host, port) for _ in range(count - 1)]
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise CliFailure(f"cannot bind {host}:{port} {count} times: {exc}") from exc
    return sockets


def serve_group(config: NodeConfig, sockets: list[socket.socket], base_id: str) -> int:
    """Run a node process on each of ``sockets`` (from :func:`bind_group`); returns the exit code.

    ``config`` must be on PostgreSQL (the caller refuses SQLite); child ``i``
    runs it as node ``<base_id>-<i>``. Returns 0 once every child stopped after
    a signal, else the code of the failure that stopped the group.
    """
    ids = member_ids(base_id, len(sockets))
    group = _Group(config, ids, int(sockets[0].getsockname()[1]))

    async def main() -> None:
        with trio.open_signal_receiver(*FORWARDED) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(group.forward_signals, signals)
                async with trio.open_nursery() as members:
                    for node_id, sock in zip(ids, sockets, strict=True):
                        members.start_soon(group.run_member, node_id, sock)
                nursery.cancel_scope.cancel()

    trio.run(main)
    return group.exit_code


def member_main() -> None:
    """A child of :func:`serve_group`: ``python -m ironflow.cli.processes LISTEN_FD CONTROL_FD``.

    Reads its :class:`NodeConfig` (JSON) from stdin and runs the node on the
    inherited listening socket, reporting to the parent on the control socket.
    """
    listen_fd, control_fd = (int(arg) for arg in sys.argv[1:3])
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=NodeConfig)
    from ironflow.cli.serve import serve_node  # the node's stack, loaded in the child only

    try:
        serve_node(config, listen_fd=listen_fd, control_fd=control_fd)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    member_main()
