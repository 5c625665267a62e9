"""The engine node: builds the nursery tree of actors and serves the API.

``python -m ironflow.node [--dev]`` — the same command as ``ironflow serve``
and ``python -m ironflow serve``, with the same flags (``ironflow/cli/serve.py``
parses them) — runs :func:`serve` under ``trio.run`` once::

    node nursery
    ├── api                 hypercorn + quart-trio (session actor per websocket),
    │                       started directly in the node's nursery, NOT
    │                       restarted: a server that dies stops the node
    │                       (its sockets and sessions cannot be resumed)
    └── supervisor          restarts each actor below after a crash, with backoff;
        │                   an actor that met a database outage waits it out instead
        ├── store-monitor       notices an outage and its end (readiness, blind time)
        ├── dispatcher          segments → sessions with free credits
        ├── capacity-scanner    loop 1
        ├── waker               elapsed sleeps, timed-out waits/invokes
        ├── scheduler           cron ticks claimed and fired (docs/schedules.md)
        ├── stale-claim-sweeper loop 2
        ├── janitor             finished history past retention → deleted
        ├── metrics-sampler     capacity gauges of /metrics (queue, leases, sessions)
        ├── kick-listener       PostgreSQL LISTEN/NOTIFY → kicks from other nodes
        ├── node-heartbeat
        └── drain-coordinator   SIGTERM/SIGINT → Shutdown to every session

This is the only module that knows every part.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from functools import partial
from typing import Any

import hypercorn.trio
import trio

from actors import (
    capacity_scanner,
    dispatcher,
    drain_coordinator,
    janitor,
    kick_listener,
    metrics_sampler,
    node_heartbeat,
    scheduler,
    stale_claim_sweeper,
    store_monitor,
    waker,
)
from actors.directory import SessionDirectory
from actors.messages import Kick
from actors.supervisor import Supervisor
from ironflow import expressions, logs
from ironflow.api import ApiDeps, HotRoutes, connections, create_app, hypercorn_patch
from ironflow.config import Limits, NodeConfig, redact_url
from ironflow.ids import default_node_id
from ironflow.store import CancelNotice, Store, StoreReadOnly, StoreUnavailable, open_store, timing

log = logging.getLogger("ironflow.node")

# Kicks coalesce; this only bounds how many can be pending at once.
KICK_BUFFER = 1024
# What a member of ``ironflow serve --processes`` writes to its parent once it serves.
READY_LINE = b"ready\n"


def expression_limits(limits: Limits) -> expressions.ExpressionLimits:
    """The expression bounds of a node's ``limits`` (ironflow/expressions.py)."""
    return expressions.ExpressionLimits(
        max_tokens=limits.expression_max_tokens,
        max_nesting=limits.expression_max_nesting,
        max_comprehension_depth=limits.expression_max_comprehension_depth,
        budget_us=limits.expression_budget_us,
    )


class StartRefused(Exception):
    """The node will not start: its database is read-only or cannot be reached."""


class Node:
    """One engine node. ``await nursery.start(node.run)`` returns once it serves.

    Attributes set once running: ``port``, ``url``, ``store``, ``supervisor``,
    ``node_id``, ``directory``, ``bootstrap_key`` (dev only).
    """

    def __init__(
        self, config: NodeConfig, *, store: Store | None = None, listen_fd: int | None = None
    ) -> None:
        """``listen_fd``: an already bound socket to serve on instead of binding
        ``config.host:config.port`` (a member of ``ironflow serve --processes``)."""
        self.config = config
        expressions.configure(expression_limits(config.limits))
        self.node_id = config.node_id or default_node_id()
        self.listen_fd = listen_fd
        self.store: Store = timing.time_store_calls(
            store if store is not None
            else open_store(
                config.database_url, sqlite_auto_vacuum=config.sqlite_auto_vacuum, timings=config.timings
            )
        )
        self.store.memo_inline_bytes = config.limits.memo_inline_bytes
        self.directory = SessionDirectory()
        # Cancel-on: the worker holding a run an event cancelled (on any node)
        # is told by the node its session is attached to (store/cancel_on.py).
        self.store.on_jobs_cancelled(self._send_cancels)
        self.shutdown_requested = trio.Event()
        self.ready = trio.Event()
        self.supervisor: Supervisor | None = None
        self.port: int | None = None
        self.url = ""
        self.bootstrap_key: str | None = None
        self._stop = trio.Event()

    def _send_cancels(self, notices: list[CancelNotice]) -> None:
        for n in notices:
            self.directory.send_cancel(n.session_id, n.job_id, n.run_id, n.reason)

    def request_shutdown(self) -> None:
        """Begin a graceful drain (what the first SIGTERM/SIGINT does)."""
        self.shutdown_requested.set()

    def stop(self) -> None:
        """Stop at once (what a second signal does)."""
        self._stop.set()

    async def _bootstrap_key(self) -> None:
        """--dev: make sure an org admin key exists and is written under state_dir."""
        path = self.config.bootstrap_key_path
        key = os.environ.get("IRONFLOW_BOOTSTRAP_ADMIN_KEY")
        if key is None and path.exists():
            try:
                key = json.loads(path.read_text())["key"]
            except (OSError, ValueError, KeyError):
                key = None
        if key is None:
            _, key = await self.store.create_api_key("org", "admin")
        elif await self.store.authenticate(key) is None:
            try:
                await self.store.create_api_key("org", "admin", key=key)
            except Exception:
                # Nodes sharing a state dir and a database (the processes of
                # `serve --processes N`) race here: the key a sibling created
                # after our check is the key we need. Anything else is raised.
                if await self.store.authenticate(key) is None:
                    raise
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key}))
        self.bootstrap_key = key

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the store, start every actor and the API, serve until stopped."""
        config = self.config
        try:
            await self.store.open()
        except (StoreReadOnly, StoreUnavailable) as exc:
            raise StartRefused(f"cannot start on {redact_url(config.database_url)}: {exc}") from exc
        try:
            if config.dev:
                await self._bootstrap_key()
            kick_send, kick_receive = trio.open_memory_channel[Kick](KICK_BUFFER)
            drained = trio.Event()
            async with trio.open_nursery() as nursery:
                supervisor = Supervisor(nursery, config.timings, self.store.availability)
                self.supervisor = supervisor
                store = self.store
                await start_actors(
                    supervisor,
                    store,
                    config,
                    self.node_id,
                    self.directory,
                    kick_send,
                    kick_receive,
                    self.shutdown_requested,
                    drained,
                )
                app = HotRoutes(create_app(
                    ApiDeps(
                        store=store,
                        config=config,
                        node_id=self.node_id,
                        directory=self.directory,
                        kicks=kick_send,
                        shutdown_requested=self.shutdown_requested,
                        ready=self.ready,
                        actors=supervisor if config.chaos else None,
                    )
                ))
                hypercorn_patch.apply()
                if not connections.apply():
                    logs.event(
                        log, logging.WARNING,
                        "node: hypercorn is not the release the connection cap was written for:"
                        " limits.max_connections is not enforced",
                    )
                hcfg = connections.ServerConfig(
                    config.limits.max_connections, config.timings.http_header_timeout_s
                )
                hcfg.bind = [
                    f"fd://{self.listen_fd}" if self.listen_fd is not None
                    else f"{config.host}:{config.port}"
                ]
                hcfg.websocket_max_message_size = config.max_frame_bytes
                # The listen queue holds a burst as large as the connection cap
                # (hypercorn's default of 100 drops the SYNs past it: a client
                # then waits the kernel's 1 s retransmit to connect).
                hcfg.backlog = max(hcfg.backlog, config.limits.max_connections)
                hcfg.graceful_timeout = 1.0
                hcfg.keep_alive_timeout = config.timings.http_keep_alive_s
                hcfg.accesslog = None
                hcfg.errorlog = logging.getLogger("hypercorn.error")
                server_stop = trio.Event()
                urls = await nursery.start(
                    partial(hypercorn.trio.serve, app, hcfg, shutdown_trigger=server_stop.wait)
                )
                self.port = _port_of(urls)
                self.url = f"http://{config.host}:{self.port}"
                self.ready.set()
                logs.event(
                    log,
                    logging.INFO,
                    "node: serving",
                    node_id=self.node_id,
                    url=self.url,
                    db=redact_url(config.database_url),
                    dev=config.dev,
                )
                if config.dev:
                    logs.event(
                        log,
                        logging.INFO,
                        "node: --dev: org endpoints need no API key; bootstrap org admin key in "
                        f"{config.bootstrap_key_path}",
                    )
                task_status.started(self)
                async with trio.open_nursery() as wait:
                    async def on_drained() -> None:
                        await drained.wait()
                        wait.cancel_scope.cancel()

                    async def on_stop() -> None:
                        await self._stop.wait()
                        wait.cancel_scope.cancel()

                    wait.start_soon(on_drained)
                    wait.start_soon(on_stop)
                self.directory.stopping.set()
                if not self.store.availability.up:
                    # Stopping while the database is silent: what it took is not awaited.
                    self.store.abandon_calls()
                server_stop.set()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.store.close()
            logs.event(log, logging.INFO, "node: stopped", node_id=self.node_id)


async def start_actors(
    supervisor: Supervisor,
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    kick_send: trio.MemorySendChannel[Kick],
    kick_receive: trio.MemoryReceiveChannel[Kick],
    shutdown_requested: trio.Event,
    drained: trio.Event,
) -> None:
    """Start every supervised actor of a node (the tree in the module docstring).

    Shared by :meth:`Node.run` and the deterministic simulator (``tests/sim``),
    so the simulated node runs exactly the actors a real one does. Returns once
    each has reported ready.
    """
    await supervisor.start("store-monitor", store_monitor.run, store, config, node_id)
    await supervisor.start("node-heartbeat", node_heartbeat.run, store, config, node_id)
    await supervisor.start("dispatcher", dispatcher.run, store, config, node_id, directory, kick_receive)
    await supervisor.start("kick-listener", kick_listener.run, store, kick_send)
    await supervisor.start("capacity-scanner", capacity_scanner.run, store, config, kick_send)
    await supervisor.start("waker", waker.run, store, config, node_id, kick_send)
    await supervisor.start("scheduler", scheduler.run, store, config, node_id, kick_send)
    await supervisor.start("stale-claim-sweeper", stale_claim_sweeper.run, store, config)
    await supervisor.start("janitor", janitor.run, store, config, node_id)
    await supervisor.start(
        "metrics-sampler",
        partial(metrics_sampler.run, store, period_s=config.timings.metrics_sample_s),
    )
    await supervisor.start(
        "drain-coordinator",
        drain_coordinator.run,
        store,
        config,
        node_id,
        directory,
        shutdown_requested,
        drained,
    )


def _port_of(urls: Any) -> int:
    for url in urls:
        tail = str(url).rsplit(":", 1)[-1].rstrip("/")
        if tail.isdigit():
            return int(tail)
    raise RuntimeError(f"hypercorn reported no port: {urls!r}")


async def _watch_signals(signals: Any, node: Node) -> None:
    count = 0
    async for signum in signals:
        count += 1
        if count == 1:
            logs.event(log, logging.INFO, "node: signal received, draining", signal=signum)
            node.request_shutdown()
        else:
            logs.event(log, logging.WARNING, "node: second signal, stopping now", signal=signum)
            node.stop()


async def _report_to_parent(control: socket.socket, node: Node) -> None:
    """Tell the parent of a process group this node serves; drain once the parent is gone.

    The parent writes nothing: end of file on ``control`` means it died
    (``kill -9``) and no signal will ever be forwarded, so the node drains
    rather than serve on as an orphan nobody stops.
    """
    sock = trio.socket.from_stdlib_socket(control)
    try:
        await node.ready.wait()
        await sock.send(READY_LINE)
        while await sock.recv(64):
            pass
    except OSError:
        pass
    finally:
        sock.close()
    logs.event(log, logging.WARNING, "node: parent process gone, draining", node_id=node.node_id)
    node.request_shutdown()


async def serve(
    config: NodeConfig, *, listen_fd: int | None = None, control_fd: int | None = None
) -> None:
    """Run a node until a signal: first SIGTERM/SIGINT drains, a second stops at once.

    ``listen_fd`` and ``control_fd`` are given to a member of ``ironflow serve
    --processes N`` (``ironflow/cli/processes.py``): the socket to serve on,
    bound by the parent, and a socket pair end on which the node reports
    :data:`READY_LINE` once it serves and learns the parent is gone (end of file).
    """
    node = Node(config, listen_fd=listen_fd)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, signals, node)
            if control_fd is not None:
                nursery.start_soon(_report_to_parent, socket.socket(fileno=control_fd), node)
            await node.run()
            nursery.cancel_scope.cancel()


def main() -> None:
    """``python -m ironflow.node``: exactly ``ironflow serve`` (flags, ``--help``, exit codes).

    The command line lives in ``ironflow/cli/serve.py``, imported here only
    when this module runs as the program (the CLI is otherwise a leaf).
    """
    from ironflow.cli import CONTEXT_SETTINGS
    from ironflow.cli.serve import serve as serve_command

    serve_command.main(prog_name="python -m ironflow.node", **CONTEXT_SETTINGS)


if __name__ == "__main__":
    main()
