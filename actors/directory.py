"""The node's directory of local worker sessions and their outboxes.

Owned by the node, not by any actor, so that it survives an actor restart: a
restarted dispatcher finds every connected session again. Sessions add and
remove themselves; the dispatcher and the drain coordinator look them up to
deliver engine messages. Nothing here touches the database.
"""

from __future__ import annotations

import math

import msgspec
import trio

from ironflow.dbclock import DatabaseClock
from ironflow.protocol import Cancel, EngineMessage, JobAssignment

# Most handed-out jobs' stored states remembered at once (each is taken at
# its job's first step; a job recovered before reporting leaves its note).
STATE_NOTES_MAX = 100_000


class LocalSession:
    """A worker session attached to this node: a streaming socket or a pull poll."""

    def __init__(
        self,
        session_id: str,
        function_ids: frozenset[str],
        outbox: trio.MemorySendChannel[EngineMessage],
        *,
        mode: str = "stream",
        delayed_start: bool = False,
    ) -> None:
        self.session_id = session_id
        self.function_ids = function_ids
        self.outbox = outbox
        self.mode = mode
        # The worker holds a job until its ``start_delay_ms`` has passed; one
        # that does not is sent a job only at its start time.
        self.delayed_start = delayed_start
        self.draining = False
        # run id → the traceparent of a traced run assigned here, for the
        # session's commit spans (ironflow/tracing.py); dropped as it ends here.
        self.traceparents: dict[str, str] = {}


class SessionDirectory:
    """session_id → :class:`LocalSession` for this node, with a change signal."""

    def __init__(self) -> None:
        self._sessions: dict[str, LocalSession] = {}
        self._changed = trio.Event()
        # Set by the drain coordinator: when this node's drain ends
        # (trio.current_time()); a pull poll during the drain is told it.
        self.drain_deadline: float | None = None
        # The database clock as the dispatcher learns it from its reservations
        # (see :func:`fresh_start`).
        self.db_clock = DatabaseClock()
        # job id → its run's step outputs stored before the segment (handed
        # out here, only when there are any), taken by the session's run state
        # budget at the job's first step (actors/session.py ``RunStateBudget``).
        self.state_before: dict[str, int] = {}
        # Set by the node when it stops (at once, or after its drain): a session
        # waiting out an outage of the store then gives up the frames it holds
        # rather than keep the node from stopping (actors/session.py).
        self.stopping = trio.Event()

    def note_state(self, job_id: str, state_bytes: int) -> None:
        """Remember a handed-out job's stored state (see :attr:`state_before`)."""
        if len(self.state_before) >= STATE_NOTES_MAX:
            self.state_before.clear()  # jobs that never reported: counted from 0 after
        self.state_before[job_id] = state_bytes

    def add(self, session: LocalSession) -> None:
        self._sessions[session.session_id] = session
        self._signal()

    def remove(self, session_id: str, outbox: object | None = None) -> None:
        """Forget a session (only if ``outbox`` still matches, when given)."""
        current = self._sessions.get(session_id)
        if current is not None and (outbox is None or current.outbox is outbox):
            del self._sessions[session_id]
            self._signal()

    def get(self, session_id: str) -> LocalSession | None:
        return self._sessions.get(session_id)

    def send_cancel(self, session_id: str, job_id: str, run_id: str, reason: str) -> bool:
        """Send ``Cancel`` to session ``session_id`` if it is attached here
        (a manual cancel, cancel-on: docs/triggers.md); False if it is not, is
        a pull poll (whose channel carries assignments only: a pull worker
        learns from its heartbeat's STALE), or its outbox is full or closed.
        The fence refuses whatever the job still sends either way."""
        local = self._sessions.get(session_id)
        if local is None or local.mode != "stream":
            return False
        try:
            local.outbox.send_nowait(Cancel(job_id, run_id, reason))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def offers(self) -> dict[str, frozenset[str]]:
        """What the dispatcher may offer work to: non-draining sessions and their functions."""
        return {s.session_id: s.function_ids for s in self._sessions.values() if not s.draining}

    def holding_offers(self) -> dict[str, frozenset[str]]:
        """:meth:`offers` to streaming sessions whose worker holds a job until
        its start time itself (``delayed_start``): what an emit's own
        reservation offers (``Store.ingest_and_reserve``), having no task to
        hold a job for a worker that cannot."""
        return {
            s.session_id: s.function_ids
            for s in self._sessions.values()
            if not s.draining and s.mode == "stream" and s.delayed_start
        }

    def streaming(self) -> list[LocalSession]:
        return [s for s in self._sessions.values() if s.mode == "stream"]

    def all(self) -> list[LocalSession]:
        return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    async def wait_changed(self) -> None:
        """Return at the next add or remove."""
        await self._changed.wait()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def fresh_start(a: JobAssignment, clock: DatabaseClock, now: float) -> JobAssignment:
    """``a`` as it should go on the wire at Trio time ``now``: a held job's
    database-clock reading (``db_now``, taken when it was reserved) advanced to
    what ``clock`` proves the database has reached by now, its
    ``start_delay_ms`` shortened by as much, so its start
    (``db_now + start_delay_ms``) is unchanged. The worker learns the clock
    from these readings: a fresh one lets it start a held job that much nearer
    its time, never before it. Whole milliseconds only, never past the start."""
    if a.db_now is None or not a.start_delay_ms:
        return a
    reached = clock.db_time(now)
    if reached is None:
        return a
    shift_ms = min(math.floor((reached - a.db_now) * 1000), a.start_delay_ms)
    if shift_ms <= 0:
        return a
    return msgspec.structs.replace(
        a, db_now=a.db_now + shift_ms / 1000, start_delay_ms=a.start_delay_ms - shift_ms
    )
