"""The node heartbeat in virtual time, on a real SQLite store running inline."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actors import node_heartbeat
from ironflow.config import NodeConfig, Timings
from ironflow.store import Store


async def heartbeat_at(store: Store) -> float:
    rows = await store._transact(  # type: ignore[attr-defined]
        lambda tx: tx.fetchall("SELECT heartbeat_at FROM nodes WHERE id = 'n1'")
    )
    assert len(rows) == 1
    return float(rows[0][0])


@pytest.mark.parametrize("shared", [False, True])
async def test_only_a_database_shared_by_nodes_gets_periodic_heartbeats(
    store: Store, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    monkeypatch.setattr(store, "shared_by_nodes", shared)
    config = NodeConfig(timings=Timings(node_heartbeat_s=10.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(node_heartbeat.run, store, config, "n1")
        registered = await heartbeat_at(store)
        await trio.sleep(35)
        later = await heartbeat_at(store)
        nursery.cancel_scope.cancel()
    if shared:
        assert later == pytest.approx(registered + 30)  # the beats at 10, 20 and 30 s
    else:
        assert later == registered  # one node owns the file: an idle node writes nothing
