"""Events that carry a trace: ingest with a W3C ``traceparent`` (``ironflow/tracing.py``).

The ingest is the one every emit uses (``ingest.py``), in the same
transaction, plus one UPDATE recording the ``traceparent`` on each new event
(a duplicate keeps the one it was first stored with); every assignment of
its runs then carries it (``dispatch.py`` reads ``events.traceparent``). Only
an emit that has a trace pays the UPDATE.
"""

from __future__ import annotations

from typing import Any

from ironflow.store.core import Tx
from ironflow.store.ingest import IngestOps
from ironflow.store.records import IngestResult


class TraceOps(IngestOps):
    """``ingest_traced_events`` (see the module docstring)."""

    async def ingest_traced_events(
        self,
        events: list[tuple[str, Any, str | None, str | None]],
        *,
        idempotency_window_s: float,
    ) -> list[IngestResult]:
        plain = [(name, data, key) for name, data, key, _ in events]

        def work(tx: Tx) -> list[IngestResult]:
            results = self._ingest_group(tx, plain, idempotency_window_s)
            for result, (_, _, _, traceparent) in zip(results, events, strict=True):
                if traceparent is not None and not result.duplicate:
                    tx.execute(
                        "UPDATE events SET traceparent = ? WHERE id = ?",
                        (traceparent, result.event_id),
                    )
            return results

        return await self._transact_ingest(work, lambda results: results, self._ingest_locks(plain))
