"""Counts of recent runs by status, per time bucket and per function: the
dashboard's runs-per-minute chart and its per-function failure rates."""

from __future__ import annotations

from ironflow.protocol import FunctionRunCount, RunBucket, RunStats
from ironflow.store.core import SqlStoreBase, Tx

# A run's bucket: whole seconds (a BIGINT cast; PostgreSQL rounds where SQLite
# truncates, a sub-second shift no per-minute chart shows) divided by the
# bucket width in integer arithmetic, on both backends.
_BUCKET = "CAST(created_at AS BIGINT) / ?"


class StatsOps(SqlStoreBase):
    """Recent runs counted by status, per bucket and per function."""

    async def run_stats(self, *, window_s: int, bucket_s: int) -> RunStats:
        def work(tx: Tx) -> RunStats:
            now = self._now(tx)
            since = now - window_s
            buckets = tx.fetchall(
                # GROUP BY position: PostgreSQL would not see two placeholders as one expression.
                f"SELECT {_BUCKET}, status, count(*) FROM runs WHERE created_at >= ? GROUP BY 1, 2",
                (bucket_s, since),
            )
            functions = tx.fetchall(
                "SELECT function_id, status, count(*) FROM runs WHERE created_at >= ?"
                " GROUP BY function_id, status ORDER BY function_id",
                (since,),
            )
            return RunStats(
                window_s=window_s,
                bucket_s=bucket_s,
                since=since,
                db_now=now,
                buckets=sorted(
                    (RunBucket(float(b * bucket_s), s, int(n)) for b, s, n in buckets),
                    key=lambda r: (r.start, r.status),
                ),
                functions=[FunctionRunCount(f, s, int(n)) for f, s, n in functions],
            )

        return await self._read(work)
