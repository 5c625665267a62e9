"""The dispatcher: matches runnable segments to local sessions with free credits.

Kicked, not polling: it runs a round whenever a producer sends a
:class:`~actors.messages.Kick` (event ingested, result, nack, recovery,
session opened), and otherwise sleeps exactly until the earliest
``eligible_at`` in the queue — so a recovery-grace or retry-delay countdown is
followed by dispatch with no tick added (deliberately beyond the seed).
"""

from __future__ import annotations

import logging
import time

import trio

from actors.directory import SessionDirectory
from actors.handout import BATCH, hand_out
from actors.messages import Kick
from ironflow.config import NodeConfig
from ironflow.store import Reservations, Store

log = logging.getLogger("ironflow.dispatcher")



async def _dispatch_round(
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    holds: trio.Nursery,
) -> tuple[Reservations | None, float]:
    """Reserve and hand out segments until the queue or the credits run dry;
    return the last reservation transaction's answer (None if none ran: no
    session had a free credit) and when it came back (``trio.current_time``).

    A job that may not start yet goes out at once to a worker that holds it
    (``delayed_start``); for any other worker it is held in ``holds`` until
    its start time."""
    last: Reservations | None = None
    reserved = trio.current_time()
    while True:
        offers = directory.offers()
        if not offers:
            return last, reserved
        reserving_ns = time.time_ns()
        reservations = last = await store.reserve_segments(
            node_id,
            offers,
            BATCH,
            reservation_expiry_s=config.timings.reservation_expiry_s,
        )
        reserved = trio.current_time()
        await hand_out(store, directory, reservations, reserving_ns, holds)
        if len(reservations) < BATCH:
            return last, reserved


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    kicks: trio.MemoryReceiveChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the dispatcher until cancelled.

    Args:
      store: engine state; every reservation is one store transaction.
      config: timings (reservation expiry, idle re-check).
      node_id: this node, recorded on reservations.
      directory: local sessions and their outboxes (owned by the node).
      kicks: wake-ups from producers; several pending kicks make one round.
    """
    async with trio.open_nursery() as holds:
        task_status.started()
        while True:
            # Swallow every pending kick: one round serves them all.
            while True:
                try:
                    kicks.receive_nowait()
                except trio.WouldBlock:
                    break
            last, read_at = await _dispatch_round(store, config, node_id, directory, holds)
            if kicks.statistics().current_buffer_used:
                # Kicked during the round: go again, no need to ask when to
                # wake. The store waits are shielded, so this is the loop's one
                # point where a cancel (shutdown, an injected crash) can land
                # while kicks keep coming.
                await trio.lowlevel.checkpoint()
                continue
            wait_s = config.timings.dispatch_idle_poll_s
            if directory.offers():
                if isinstance(last, Reservations) and last.next_eligible_known:
                    # Read by the round's last transaction: less the time since.
                    next_eligible = last.next_eligible
                    if next_eligible is not None and next_eligible > 0:
                        next_eligible = max(next_eligible - (trio.current_time() - read_at), 1e-6)
                else:
                    next_eligible = await store.seconds_until_next_eligible()
                # 0 means "every row is eligible now but none could start" (no
                # free credit, a full concurrency limit): only a kick (a freed
                # slot, a new session) can change that. A row due later (a
                # throttled start) is counted even while others wait so.
                if next_eligible is not None and next_eligible > 0:
                    wait_s = min(wait_s, next_eligible)
            with trio.move_on_after(wait_s):
                await kicks.receive()
