"""The chaos routes: served only by a ``--chaos`` node, only to platform keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from ironflow.config import load_config
from ironflow.engine.metrics import ACTOR_RESTARTS
from ironflow.node import Node
from tests.integration.conftest import TEST_TIMINGS
from tests.integration.test_bad_input import assert_node_still_works


async def start_node(
    nursery: trio.Nursery, tmp_path: Path, *, chaos: bool, **timings: Any
) -> Node:
    config = load_config(
        env={},
        dev=True,
        overrides={"db": str(tmp_path / "db.sqlite"), "port": 0, "state_dir": str(tmp_path),
                   "chaos": chaos},
        timing_overrides={**TEST_TIMINGS, **timings},
    )
    node: Node = await nursery.start(Node(config).run)
    return node


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_chaos_routes_are_an_unknown_route_without_the_flag(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    node = await start_node(nursery, tmp_path, chaos=False)
    _, platform = await node.store.create_api_key("platform", "platform_admin")
    async with httpx.AsyncClient(base_url=node.url, headers=bearer(platform)) as http:
        listed = await http.get("/v1/chaos/actors")
        crashed = await http.post("/v1/chaos/crash", json={"actor": "dispatcher"})
    for resp in (listed, crashed):
        assert resp.status_code == 404 and resp.json()["code"] == "NOT_FOUND"
    assert node.supervisor is not None and node.supervisor.restarts("dispatcher") == 0
    node.stop()


async def test_chaos_crash_needs_a_platform_key(tmp_path: Path, nursery: trio.Nursery) -> None:
    node = await start_node(nursery, tmp_path, chaos=True)
    _, org = await node.store.create_api_key("org", "admin")
    async with httpx.AsyncClient(base_url=node.url) as http:
        for headers in ({}, bearer(org)):
            resp = await http.post("/v1/chaos/crash", json={"actor": "dispatcher"}, headers=headers)
            assert resp.status_code == 403 and resp.json()["code"] == "FORBIDDEN"
    assert node.supervisor is not None and node.supervisor.restarts("dispatcher") == 0
    node.stop()


async def test_chaos_crash_restarts_the_actor_and_the_node_keeps_serving(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    node = await start_node(nursery, tmp_path, chaos=True)
    assert node.supervisor is not None
    _, platform = await node.store.create_api_key("platform", "platform_admin")
    metric_before = ACTOR_RESTARTS.labels(actor="dispatcher")._value.get()
    async with httpx.AsyncClient(base_url=node.url, headers=bearer(platform)) as http:
        listed = (await http.get("/v1/chaos/actors")).json()["actors"]
        assert {a["name"] for a in listed} == set(node.supervisor.names)
        assert all(a["restarts"] == 0 for a in listed)

        resp = await http.post("/v1/chaos/crash", json={"actor": "dispatcher"})
        assert resp.status_code == 202, resp.text
        with trio.fail_after(5):
            while node.supervisor.restarts("dispatcher") == 0:
                await trio.sleep(0.01)
        after = {a["name"]: a["restarts"] for a in (await http.get("/v1/chaos/actors")).json()["actors"]}
        assert after["dispatcher"] == 1 and sum(after.values()) == 1
        assert ACTOR_RESTARTS.labels(actor="dispatcher")._value.get() == metric_before + 1

        unknown = await http.post("/v1/chaos/crash", json={"actor": "nope"})
        assert unknown.status_code == 404 and unknown.json()["code"] == "ACTOR_NOT_FOUND"
        assert "dispatcher" in unknown.json()["message"]
        bad = await http.post("/v1/chaos/crash", json={"actor": 5})
        assert bad.status_code == 400 and bad.json()["code"] == "VALIDATION_ERROR"

        # The restarted dispatcher still hands work out.
        await assert_node_still_works(node, http, nursery)
    node.stop()


async def test_chaos_crash_during_the_restart_backoff_is_a_409(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    node = await start_node(nursery, tmp_path, chaos=True, restart_backoff_s=30.0, restart_backoff_max_s=30.0)
    assert node.supervisor is not None
    _, platform = await node.store.create_api_key("platform", "platform_admin")
    async with httpx.AsyncClient(base_url=node.url, headers=bearer(platform)) as http:
        assert (await http.post("/v1/chaos/crash", json={"actor": "janitor"})).status_code == 202
        # The second request lands inside the first crash's 30 s backoff.
        resp = await http.post("/v1/chaos/crash", json={"actor": "janitor"})
    assert resp.status_code == 409 and resp.json()["code"] == "ACTOR_RESTARTING"
    assert node.supervisor.restarts("janitor") == 1
    node.stop()
