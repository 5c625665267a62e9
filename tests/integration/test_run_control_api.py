"""Run control's HTTP routes refuse bad input clearly and change nothing
(docs/run-control.md)."""

from __future__ import annotations

import httpx

from ironflow.node import Node


async def test_bad_resume_and_pause_requests_are_refused_and_change_nothing(node: Node, http: httpx.AsyncClient) -> None:
    missing = await http.post("/v1/runs/run_nope/resume", json={"from_step": None})
    assert missing.status_code == 404 and missing.json()["code"] == "RUN_NOT_FOUND"
    assert (await http.post("/v1/runs/run_nope/pause")).status_code == 404
    too_many = await http.post("/v1/runs/resume", json={"since_s": 3600, "limit": 501})
    assert too_many.status_code in (400, 422) and "limit" in too_many.json()["message"]
    no_window = await http.post("/v1/runs/resume", json={"limit": 5})
    assert no_window.status_code in (400, 422) and "since_s" in no_window.json()["message"]
    unknown = await http.post("/v1/runs/x/resume", json={"from_step": None, "extra": 1})
    assert unknown.status_code in (400, 422)
    empty = await http.post("/v1/runs/resume", json={"since_s": 3600, "function_id": "nothing"})
    assert empty.status_code == 200 and empty.json() == {"resumed": [], "next_cursor": None}
    bad_cursor = await http.post("/v1/runs/resume", json={"since_s": 3600, "cursor": "garbage"})
    assert bad_cursor.status_code == 404 and "cursor" in bad_cursor.json()["message"]
    assert (await http.get("/v1/runs")).json()["runs"] == []
    assert (await http.get("/v1/audit", params={"type": "run.resumed"})).json()["events"] == []
