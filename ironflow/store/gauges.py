"""The counts behind ``/metrics``' capacity gauges, in one short read."""

from __future__ import annotations

from ironflow.store.core import SqlStoreBase, Tx
from ironflow.store.records import CapacityGauges


class GaugeOps(SqlStoreBase):
    """Queue depth by state, active leases, live sessions by mode."""

    async def capacity_gauges(self) -> CapacityGauges:
        def work(tx: Tx) -> CapacityGauges:
            row = tx.fetchone(
                "SELECT"
                " (SELECT count(*) FROM dispatch_queue WHERE eligible_at <= ironflow_now()),"
                " (SELECT count(*) FROM dispatch_queue"
                "  WHERE eligible_at > ironflow_now() AND reason = 'recovery'),"
                " (SELECT count(*) FROM dispatch_queue"
                "  WHERE eligible_at > ironflow_now() AND reason <> 'recovery'),"
                " (SELECT count(*) FROM concurrency_leases)"
            )
            assert row is not None
            modes = tx.fetchall(
                "SELECT mode, count(*) FROM worker_sessions WHERE expires_at > ironflow_now()"
                " GROUP BY mode"
            )
            return CapacityGauges(
                int(row[0]), int(row[1]), int(row[2]), int(row[3]), {m: int(n) for m, n in modes}
            )

        return await self._read(work)
