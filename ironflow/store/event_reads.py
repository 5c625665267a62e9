"""Recent events with the runs they started, and re-running a run's event.

Read by the dashboard's events view and its "re-run" action; a re-run is a
new run of the same function with the same stored event, never a second
emit (which would start every function the event triggers).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ironflow.protocol import EventList, EventRecord, FlowNote
from ironflow.store.base import FunctionNotFound, NotFound, RunNotFound
from ironflow.store.core import SqlStoreBase, Tx, dec, enc
from ironflow.store.creation import create_run
from ironflow.store.filters import EventNotes, notes_decode
from ironflow.store.pages import Keyset, PageQuery, read_page
from ironflow.store.records import PageRequest
from ironflow.store.transitions import audit_if_enabled

_EVENT_COLS = "id, name, data, received_at, run_ids, idempotency_key, notes, flow"
_flow_decode = msgspec.json.Decoder(list[FlowNote]).decode
# Events newest first, by arrival (indexes events_page, events_name_page).
EVENTS_ORDER = Keyset("events", "received_at", "id", descending=True)
# The columns besides ``data`` whose size the event chose (store/pages.py).
_SIZED = ("run_ids", "notes", "flow")


def _event_record(row: Any) -> EventRecord:
    # ``notes``: the functions it did not start and the runs it cancelled (filters.py).
    notes = EventNotes() if row[6] is None else notes_decode(row[6])
    flow = _flow_decode(row[7]) if row[7] else []  # store/flow.py: what flow control did
    return EventRecord(
        row[0], row[1], dec(row[2]), row[3], dec(row[4]) or [], row[5],
        filtered=notes.filtered, cancelled_run_ids=notes.cancelled_run_ids, flow=flow,
    )


def _listed_event(row: Any) -> EventRecord:
    """An event as a list shows it without ``?include=data``."""
    return msgspec.structs.replace(_event_record(row), omitted=["data"])


class EventReadOps(SqlStoreBase):
    """Recent events with their runs, one event, and a run's re-run."""

    async def list_events(self, *, name: str | None = None, limit: int = 50) -> list[EventRecord]:
        return (await self.events_page(PageRequest(limit=limit, include_data=True), name=name)).events

    async def events_page(self, page: PageRequest, *, name: str | None = None) -> EventList:
        query = PageQuery(
            EVENTS_ORDER,
            _EVENT_COLS if page.include_data else _EVENT_COLS.replace("data", "NULL"),
            "events",
            {"name": name},
            ("data", *_SIZED) if page.include_data else _SIZED,
            _event_record if page.include_data else _listed_event,
            lambda record: (record.received_at, record.id),
        )
        events, cursor = await self._read(lambda tx: read_page(tx, query, page))
        return EventList(events, cursor)

    async def get_event(self, event_id: str) -> EventRecord:
        def work(tx: Tx) -> EventRecord:
            row = tx.fetchone(f"SELECT {_EVENT_COLS} FROM events WHERE id = ?", (event_id,))
            if row is None:
                raise NotFound(f"event {event_id} not found")
            return _event_record(row)

        return await self._read(work)

    async def rerun(self, run_id: str) -> tuple[str, str]:
        def work(tx: Tx) -> tuple[str, str]:
            run = tx.fetchone(
                "SELECT r.event_id, e.data, f.definition, e.name, f.deleted_at, f.id FROM runs r"
                " JOIN events e ON e.id = r.event_id"
                " JOIN functions f ON f.id = r.function_id WHERE r.id = ?",
                (run_id,),
            )
            if run is None:
                raise RunNotFound(f"run {run_id} not found, or its event or function is gone")
            event_id, data_text, definition, event_name, deleted_at, function_id = run
            if deleted_at is not None:  # ironflow/store/function_life.py
                raise FunctionNotFound(
                    f"function {function_id} was deleted; a worker registering it restores it"
                )
            fd = self._fdef_or_none(definition)
            if fd is None:
                raise NotFound(
                    f"run {run_id}'s function has a stored definition this version refuses;"
                    " restart its worker to register it again"
                )
            new_run_id = create_run(tx, self.definitions, fd, event_id, dec(data_text), event_name=event_name)
            row = tx.fetchone("SELECT run_ids FROM events WHERE id = ?", (event_id,))
            run_ids = (dec(row[0]) if row else None) or []
            tx.execute(
                "UPDATE events SET run_ids = ? WHERE id = ?", (enc([*run_ids, new_run_id]), event_id)
            )
            audit_if_enabled(tx, "run.rerun", new_run_id, {"rerun_of": run_id})
            return new_run_id, event_id

        return await self._transact(work)
