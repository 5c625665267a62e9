"""Pages of the list reads (ironflow/store/pages.py), on each backend: keyset
order, stable under inserts, capped in rows and bytes, payloads only when asked."""

from __future__ import annotations

import base64

import msgspec
import pytest

from ironflow.protocol import encoder
from ironflow.store import InvalidCursor, PageRequest, Store
from tests.store.behaviour import emit, fn, worker


async def walk_events(store: Store, page: PageRequest, **kw) -> list[list[str]]:
    """Every page of events from the first, as lists of ids."""
    pages: list[list[str]] = []
    cursor = None
    while True:
        answer = await store.events_page(msgspec.structs.replace(page, cursor=cursor), **kw)
        pages.append([e.id for e in answer.events])
        if answer.next_cursor is None:
            return pages
        cursor = answer.next_cursor


async def test_events_page_by_page_newest_first_each_once_without_data(store):
    ids = [(await emit(store, "page.e", {"i": i})).event_id for i in range(23)]
    pages = await walk_events(store, PageRequest(limit=5), name="page.e")
    assert [len(p) for p in pages] == [5, 5, 5, 5, 3]
    assert [i for p in pages for i in p] == ids[::-1]
    first = await store.events_page(PageRequest(limit=2), name="page.e")
    assert [e.data for e in first.events] == [None, None]
    assert all(e.omitted == ["data"] for e in first.events)
    with_data = await store.events_page(PageRequest(limit=2, include_data=True), name="page.e")
    assert [e.data for e in with_data.events] == [{"i": 22}, {"i": 21}]
    assert all(e.omitted == [] for e in with_data.events)
    # An exact fit: no cursor after the last page, none for an empty list.
    assert (await store.events_page(PageRequest(limit=23), name="page.e")).next_cursor is None
    empty = await store.events_page(PageRequest(limit=5), name="nothing.here")
    assert empty.events == [] and empty.next_cursor is None


async def test_a_walk_sees_each_row_committed_before_it_once_whatever_is_inserted_meanwhile(store):
    before = [(await emit(store, "page.c", {"i": i})).event_id for i in range(12)]
    first = await store.events_page(PageRequest(limit=4), name="page.c")
    # Inserted between pages: newer than the first page's rows, so behind the walk.
    during = [(await emit(store, "page.c", {"late": i})).event_id for i in range(6)]
    seen = [e.id for e in first.events]
    cursor = first.next_cursor
    while cursor is not None:
        page = await store.events_page(PageRequest(limit=4, cursor=cursor), name="page.c")
        seen += [e.id for e in page.events]
        cursor = page.next_cursor
    assert seen == before[::-1]  # none missed, none twice, none of the later ones
    assert not set(seen) & set(during)


async def test_rows_of_one_timestamp_page_by_id(store):
    ids = [(await emit(store, "page.t", {"i": i})).event_id for i in range(9)]
    write = getattr(store, "_write", None) or store._transact  # SQLite's writer, PostgreSQL's
    await write(lambda tx: tx.execute("UPDATE events SET received_at = 1000.5 WHERE name = 'page.t'"))
    pages = await walk_events(store, PageRequest(limit=2), name="page.t")
    assert [len(p) for p in pages] == [2, 2, 2, 2, 1]
    assert [i for p in pages for i in p] == sorted(ids, reverse=True)  # by id, newest order


async def test_a_page_stops_at_its_byte_cap_and_a_larger_row_is_alone_on_its_page(store):
    blob = "x" * 20_000
    for i in range(7):
        await emit(store, "page.b", {"i": i, "blob": blob})
    await emit(store, "page.b", {"i": "big", "blob": "y" * 90_000})  # the newest
    page = PageRequest(limit=100, include_data=True, max_bytes=65_536)
    sizes: list[int] = []
    ids: list[str] = []
    cursor = None
    while True:
        answer = await store.events_page(msgspec.structs.replace(page, cursor=cursor), name="page.b")
        assert answer.events, "a page that is not the last holds at least one row"
        body = encoder.encode(answer.events)
        sizes.append(len(body))
        ids += [e.id for e in answer.events]
        if answer.next_cursor is None:
            break
        cursor = answer.next_cursor
    assert sizes[0] > 65_536 and len(encoder.encode([ids[0]])) < 100  # the big row, alone
    assert all(size <= 65_536 for size in sizes[1:])
    assert len(ids) == len(set(ids)) == 8
    # Without the payloads the same eight fit on one page.
    lean = await store.events_page(PageRequest(limit=100, max_bytes=65_536), name="page.b")
    assert len(lean.events) == 8 and lean.next_cursor is None


async def test_runs_page_filters_pages_and_leaves_outputs_out(store):
    await worker(store, fn("pa", "page.r"), fn("pb", "page.r"))
    for _ in range(6):
        await emit(store, "page.r", {"x": 1})
    all_runs = (await store.runs_page(PageRequest(limit=100))).runs
    assert len(all_runs) == 12
    of_a: list[str] = []
    cursor = None
    while True:
        answer = await store.runs_page(PageRequest(limit=4, cursor=cursor), function_id="pa")
        of_a += [r.id for r in answer.runs]
        assert {r.function_id for r in answer.runs} == {"pa"}
        cursor = answer.next_cursor
        if cursor is None:
            break
    assert of_a == [r.id for r in all_runs if r.function_id == "pa"]
    waiting = await store.runs_page(PageRequest(limit=100), status="waiting_for_capacity")
    assert len(waiting.runs) == 12
    assert (await store.runs_page(PageRequest(limit=100), status="completed")).runs == []
    # The first page as the store's own callers read it: outputs included.
    assert [r.id for r in await store.list_runs(limit=3)] == [r.id for r in all_runs[:3]]


async def test_audit_pages_oldest_first(store):
    await worker(store, fn("pz", "page.z"))
    for _ in range(5):
        await store.pause_function("pz", by="test")
        await store.resume_function("pz", catchup=False, by="test", node_id="n1")
    entries = (await store.audit_page(PageRequest(limit=1000, include_data=True))).events
    assert len(entries) >= 10 and [e.at for e in entries] == sorted(e.at for e in entries)
    ids: list[str] = []
    cursor = None
    while True:
        answer = await store.audit_page(PageRequest(limit=3, cursor=cursor))
        assert all(e.data is None and e.omitted == ["data"] for e in answer.events)
        ids += [e.id for e in answer.events]
        cursor = answer.next_cursor
        if cursor is None:
            break
    assert ids == [e.id for e in entries]


@pytest.mark.parametrize(
    "cursor",
    [
        "not base64 at all!",
        base64.urlsafe_b64encode(b"[1, 2").decode(),
        base64.urlsafe_b64encode(b'{"a": 1}').decode(),
        base64.urlsafe_b64encode(b'["events", "soon", "evt_1"]').decode(),
        base64.urlsafe_b64encode(b'["events", 1e400, "evt_1"]').decode(),
        "é" * 10,
        "A" * 600,
    ],
)
async def test_a_cursor_this_list_did_not_issue_is_refused(store, cursor):
    with pytest.raises(InvalidCursor):
        await store.events_page(PageRequest(cursor=cursor))


async def test_one_lists_cursor_is_refused_by_another(store):
    for i in range(3):
        await emit(store, "page.x", {"i": i})
    cursor = (await store.events_page(PageRequest(limit=1))).next_cursor
    assert cursor is not None
    with pytest.raises(InvalidCursor, match="events"):
        await store.runs_page(PageRequest(cursor=cursor))
    with pytest.raises(InvalidCursor):
        await store.audit_page(PageRequest(cursor=cursor))
