"""The list routes are bounded: no payloads unless asked, a page capped in rows
and in bytes, every list paged by cursor; the worst page a caller can ask for
is read while ``/healthz`` keeps answering (both backends, a real node)."""

from __future__ import annotations

import base64

import httpx
import pytest
import trio

import ironflow
from ironflow.config import MAX_FRAME_BYTES
from ironflow.node import Node
from tests.integration.helpers import emit

# /healthz answers are timed while the costliest pages are read.
pytestmark = pytest.mark.serial
HEALTHZ_BOUND_S = 0.050


async def walk(http: httpx.AsyncClient, path: str, key: str, **params: object) -> list[dict]:
    """Every page of a list route from the first, their records in order."""
    records: list[dict] = []
    cursor = None
    while True:
        resp = await http.get(path, params={**params, **({"cursor": cursor} if cursor else {})})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        records += body[key]
        cursor = body["next_cursor"]
        if cursor is None:
            return records


async def test_lists_carry_no_payloads_unless_asked_and_page_by_cursor(node: Node, http: httpx.AsyncClient):
    emitted = [await emit(http, "reads.small", {"card": f"4111-{i}"}) for i in range(7)]
    page = (await http.get("/v1/events", params={"name": "reads.small", "limit": 3})).json()
    assert [e["id"] for e in page["events"]] == [e["event_id"] for e in emitted[::-1][:3]]
    assert all(e["data"] is None and e["omitted"] == ["data"] for e in page["events"])
    assert page["next_cursor"]
    every = await walk(http, "/v1/events", "events", name="reads.small", limit=3)
    assert [e["id"] for e in every] == [e["event_id"] for e in emitted[::-1]]
    full = (await http.get("/v1/events", params={"name": "reads.small", "include": "data"})).json()
    assert [e["data"] for e in full["events"]] == [{"card": f"4111-{i}"} for i in reversed(range(7))]
    assert full["next_cursor"] is None
    one = (await http.get(f"/v1/events/{emitted[0]['event_id']}")).json()
    assert one["data"] == {"card": "4111-0"}  # the single-item GET has it

    audit = await walk(http, "/v1/audit", "events", limit=2)
    assert all(a["data"] is None for a in audit)
    assert [a["id"] for a in audit] == [
        a["id"] for a in (await http.get("/v1/audit", params={"limit": 1000})).json()["events"]
    ]
    assert (await http.get("/v1/runs", params={"limit": 5})).json() == {"runs": [], "next_cursor": None}


async def test_runs_page_by_cursor_over_http_and_in_the_client(node: Node, http: httpx.AsyncClient):
    resp = await http.post(
        "/v1/worker/register",
        json={"type": "register", "worker_id": "w-reads", "functions": [{"id": "reads-fn", "triggers": [{"event": "reads.run"}]}]},
    )
    assert resp.status_code == 201, resp.text
    started = [(await emit(http, "reads.run", {"i": i}))["run_ids"][0] for i in range(7)]
    listed = await walk(http, "/v1/runs", "runs", function="reads-fn", limit=3)
    assert [r["id"] for r in listed] == started[::-1]
    assert all("output" not in r["omitted"] for r in listed)  # none has an output yet
    async with ironflow.Ironflow(node.url) as client:
        assert [r.id async for r in client.iter_runs(function="reads-fn", page_size=2)] == started[::-1]
        assert [r.id for r in await client.list_runs(function="reads-fn", limit=2)] == started[::-1][:2]
        assert [e.data for e in await client.list_events(name="reads.run", limit=1, include_data=True)] == [{"i": 6}]


async def test_bad_paging_parameters_are_refused_with_the_limit_named(node: Node, http: httpx.AsyncClient):
    await emit(http, "reads.bad", {})
    await emit(http, "reads.bad", {})
    too_many = await http.get("/v1/runs", params={"limit": 1001})
    assert too_many.status_code == 422 and too_many.json()["code"] == "LIMIT_EXCEEDED"
    assert "limits.max_page_rows" in too_many.json()["message"]
    for path in ("/v1/events", "/v1/runs", "/v1/audit"):
        for cursor in ("garbage!", base64.urlsafe_b64encode(b'["other", 1.0, "x"]').decode(), "Z" * 5000):
            resp = await http.get(path, params={"cursor": cursor})
            assert resp.status_code == 422 and resp.json()["code"] == "INVALID_CURSOR", (path, resp.text)
        for params in ({"limit": "ten"}, {"limit": 0}, {"include": "everything"}):
            resp = await http.get(path, params=params)
            assert resp.status_code == 400 and resp.json()["code"] == "VALIDATION_ERROR", (path, params)
    # One list's cursor is not another's.
    cursor = (await http.get("/v1/events", params={"limit": 1})).json()["next_cursor"]
    resp = await http.get("/v1/audit", params={"cursor": cursor})
    assert resp.status_code == 422 and resp.json()["code"] == "INVALID_CURSOR"
    assert (await http.get("/healthz")).status_code == 200


async def test_the_largest_page_is_capped_in_bytes_while_healthz_answers(node: Node, http: httpx.AsyncClient):
    # Six events near the largest body the node accepts, read a thousand to a page.
    blob = "x" * (MAX_FRAME_BYTES // 4)
    ids = [(await emit(http, "reads.big", {"blob": blob, "i": i}))["event_id"] for i in range(6)]
    seen: list[float] = []
    done = trio.Event()

    async def poll() -> None:
        while not done.is_set():
            started = trio.current_time()
            assert (await http.get("/healthz")).status_code == 200
            seen.append(trio.current_time() - started)
            await trio.sleep(0.01)

    sizes: list[int] = []
    read: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        for _ in range(3):
            read.clear()
            cursor = None
            while True:
                params = {"name": "reads.big", "limit": 1000, "include": "data", **({"cursor": cursor} if cursor else {})}
                resp = await http.get("/v1/events", params=params)
                assert resp.status_code == 200
                sizes.append(len(resp.content))
                read += [e["id"] for e in resp.json()["events"]]
                cursor = resp.json()["next_cursor"]
                if cursor is None:
                    break
        done.set()
    assert read == ids[::-1]
    assert max(sizes) <= node.config.limits.max_page_bytes + 1024  # the records, and the envelope
    assert len(sizes) >= 3 * 2  # six quarter-frame events do not fit one page
    print(f"largest pages: {len(sizes)} pages, max {max(sizes)} bytes; /healthz max {max(seen) * 1000:.1f} ms")
    assert max(seen) < HEALTHZ_BOUND_S, f"/healthz took {max(seen) * 1000:.1f} ms while pages were read"
