"""Drain, stop and signal handling shared by the streaming and the pull worker.

Seed (graceful-drain.txt): SIGTERM/SIGINT or ``drain()`` puts the worker in
draining at once; running jobs get until the deadline; a second signal stops
at once; ``stop()`` stops at once.
"""

from __future__ import annotations

import logging
import signal

import trio

_log = logging.getLogger("ironflow.worker")


class WorkerLifecycle:
    """Mixin: the worker sets these attributes in its ``__init__``."""

    worker_id: str
    state: str
    drain_timeout: float
    _draining: bool
    _drain_deadline: float
    _stopped: bool
    _running: bool
    _finished: trio.Event
    _root_scope: trio.CancelScope | None

    async def drain(self, timeout: float | None = None) -> None:
        """Drain now (refuse new jobs, finish running ones until the deadline) and wait."""
        self._begin_drain(self.drain_timeout if timeout is None else timeout)
        if self._running:
            await self._finished.wait()

    def stop(self) -> None:
        """Stop at once: running jobs are cancelled and report nothing."""
        self._stopped = True
        if self._root_scope is not None:
            self._root_scope.cancel()

    def _begin_drain(self, timeout: float) -> None:
        if self._draining:
            return  # a drain in progress keeps its original deadline
        self._draining = True
        self.state = "draining"
        self._drain_deadline = trio.current_time() + max(timeout, 0.0)
        _log.info("Draining worker...", extra={"fields": {"worker_id": self.worker_id}})
        self._drain_started()

    def _drain_started(self) -> None:
        """Transport-specific reaction to a drain (wake what waits for new work)."""

    async def _watch_signals(self) -> None:
        try:
            receiver = trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
        except RuntimeError as exc:  # not the main thread
            _log.warning("signal handling unavailable: %s", exc)
            return
        with receiver as signals:
            async for signum in signals:
                if not self._draining:
                    _log.info("Received signal %s", signal.Signals(signum).name)
                    self._begin_drain(self.drain_timeout)
                else:
                    _log.info("Second signal; stopping now")
                    self.stop()
                    return
