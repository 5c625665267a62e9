"""A completion's reservation round on PostgreSQL (``complete_jobs_and_reserve``)
beside another node's round, forced: the completion's transaction held
before its commit while the other round starts — never a sleep."""

from __future__ import annotations

from ironflow.protocol import Concurrency
from tests.store.behaviour import RESERVATION, emit, fn, reserve, running, worker
from tests.store.pg_holds import race_calls


async def test_a_completions_reservation_and_another_nodes_round_never_both_pass_a_limit(stores, pg_url):
    """The completion's transaction holds ``conc:<function>`` from its BEGIN
    (the round's named locks are declared with the call) and frees the
    limit's one slot; the other node's round waits for it at its own BEGIN,
    then counts the completion's new reservation in that slot."""
    a, b = stores
    session = await worker(a, fn("f", concurrency=Concurrency(limit=1)), slots=3)
    done = await running(a, session)
    queued = await emit(a)  # the limit is full: it waits
    answer, theirs, b_finished_while_held = await race_calls(
        a, pg_url,
        lambda: a.complete_jobs_and_reserve(
            [(done, "ok", [])],
            offers={session.session_id: frozenset(session.function_ids)},
            limit=10,
            reservation_expiry_s=RESERVATION,
        ),
        lambda: reserve(b, session),
    )
    (result,), (ours,) = answer
    assert not b_finished_while_held, "the other round passed the completion's conc: lock"
    assert result.unwrap().status == "completed"
    assert ours.assignment.run_id == queued.run_ids[0]
    assert theirs == []  # the slot the completion freed is its own reservation's
