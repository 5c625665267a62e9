"""The emit's reservation on PostgreSQL (``SqlStore.ingest_and_reserve``):
the interleaving with another node's reservation round, forced by holding
the emit's transaction before its commit (never a sleep), and the kick it
sends other nodes only for what its round left behind."""

from __future__ import annotations

import psycopg

from ironflow.protocol import Concurrency, FunctionDef, Trigger
from ironflow.store.postgres import KICK_CHANNEL, PostgresStore
from tests.store.behaviour import RESERVATION, reserve, worker
from tests.store.pg_holds import race_calls

EVENT = "emit.reserve"
LIMITED = FunctionDef(id="one-at-a-time", triggers=[Trigger(EVENT)], concurrency=Concurrency(limit=1))
PLAIN = FunctionDef(id="plain", triggers=[Trigger(EVENT)])



async def emit_reserving(store: PostgresStore, session, data: object = None):
    return await store.ingest_and_reserve(
        [(EVENT, data, None)],
        idempotency_window_s=60,
        offers={session.session_id: frozenset(session.function_ids)},
        limit=10,
        reservation_expiry_s=RESERVATION,
    )


async def test_an_emits_reservation_and_another_nodes_round_never_both_pass_a_limit(stores, pg_url):
    """The emit's transaction holds ``conc:<function>`` from its BEGIN (the
    round's named locks are declared with the call); the other node's round
    waits for it at its own BEGIN, then counts the emit's reservation."""
    a, b = stores
    session = await worker(a, LIMITED, slots=3)
    emit_answer, theirs, b_finished_while_held = await race_calls(
        a, pg_url,
        lambda: emit_reserving(a, session),
        lambda: reserve(b, session),
    )
    (emitted,), (ours,) = emit_answer
    assert not b_finished_while_held, "the other round passed the emit's conc: lock"
    assert ours.assignment.run_id == emitted.run_ids[0]
    assert theirs == []  # the limit's one slot is the emit's reservation


def _kicks_before_marker(conn: psycopg.Connection, marker: str) -> int:
    """Kick notifications delivered before ``marker`` (sent after the calls
    under test committed: notifications arrive in commit order)."""
    kicks = 0
    for note in conn.notifies(timeout=10):
        if note.payload == marker:
            return kicks
        kicks += note.channel == KICK_CHANNEL
    raise AssertionError("the marker notification never came")


async def test_the_emit_kicks_other_nodes_only_for_a_run_its_round_left(stores, pg_url):
    a, _ = stores
    session = await worker(a, PLAIN, slots=1)
    with psycopg.connect(pg_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {KICK_CHANNEL}")
        (first,), reserved = await emit_reserving(a, session)  # the one credit takes it
        assert [r.assignment.run_id for r in reserved] == first.run_ids
        listener.execute("SELECT pg_notify(%s, 'after-first')", (KICK_CHANNEL,))
        assert _kicks_before_marker(listener, "after-first") == 0
        (second,), reserved = await emit_reserving(a, session)  # no credit left: queued
        assert reserved == [] and second.run_ids
        listener.execute("SELECT pg_notify(%s, 'after-second')", (KICK_CHANNEL,))
        assert _kicks_before_marker(listener, "after-second") == 1
