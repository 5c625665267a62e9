"""No expression a tenant registers, and no event it sends, holds the node's
thread: past a size, nesting or comprehension limit registration is refused
(422 naming the limit and the place); the costliest expression accepted runs
while ``/healthz`` keeps answering; an evaluation over its budget on an event
is not run, and the event record says why (EXPRESSION_BUDGET_EXCEEDED)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from ironflow.expressions import ExpressionError, compile_expression
from ironflow.node import Node
from tests.integration.helpers import emit

# Each asserts a wall-clock bound (other runs within 2 s, /healthz within 50 ms).
pytestmark = pytest.mark.serial
# What /healthz may take while the worst is being evaluated.
HEALTHZ_BOUND_S = 0.050


def literal(k: int) -> str:
    return "[" + ",".join(str(i) for i in range(k)) + "]"


def costliest_accepted() -> str:
    """The costliest of the expression shapes known to cost most (nested
    comprehensions rebuilding their lists) that the node's limits accept."""
    shapes = [
        lambda k: f"{literal(k)}.map(a, {literal(k)}.map(b, a * b)).size() == event.data.x",
        lambda k: f"{literal(k)}.exists(a, {literal(k)}.exists(b, event.data.x == a + b))",
        lambda k: f"{literal(k)}.filter(a, a % 7 == event.data.x).size() > 0",
    ]
    best: tuple[float, str] = (0.0, "")
    for shape in shapes:
        for k in range(2, 1000):
            try:
                cost = compile_expression(shape(k)).static_cost_us
            except ExpressionError:
                break
            best = max(best, (cost, shape(k)))
    return best[1]


async def register(http: httpx.AsyncClient, function: dict[str, Any]) -> httpx.Response:
    return await http.post(
        "/v1/worker/register", json={"type": "register", "worker_id": "w-budget", "functions": [function]}
    )


async def poll_healthz(http: httpx.AsyncClient, seen: list[float], done: trio.Event) -> None:
    """``/healthz`` every 10 ms until ``done``, each answer's time in ``seen``."""
    while not done.is_set():
        started = trio.current_time()
        resp = await http.get("/healthz")
        assert resp.status_code == 200
        seen.append(trio.current_time() - started)
        await trio.sleep(0.010)


async def test_the_nested_comprehension_that_froze_the_node_is_refused_at_registration(
    node: Node, http: httpx.AsyncClient
) -> None:
    attack = "event.data.x == 1"
    for i in range(7):  # 255 characters that took 6 s to evaluate once
        attack = f"[0,1,2,3,4,5,6,7,8,9].exists(a{i}, {attack})"
    resp = await register(http, {"id": "frozen", "triggers": [{"event": "e", "expression": attack}]})
    assert resp.status_code == 422, resp.text
    message = resp.json()["message"]
    assert "triggers[0].expression" in message and "line 1, column" in message
    assert "limits.expression_max_comprehension_depth" in message
    resp = await http.get("/v1/functions")
    assert "frozen" not in resp.text


async def test_the_costliest_accepted_expression_leaves_healthz_within_50_ms(
    node: Node, http: httpx.AsyncClient
) -> None:
    worst = costliest_accepted()
    resp = await register(http, {"id": "worst", "triggers": [{"event": "worst.go", "expression": worst}]})
    assert resp.status_code in (200, 201), resp.text
    seen: list[float] = []
    done = trio.Event()
    # The poller's own nursery: it ends (its last GET answered) before the
    # prober's connections are closed.
    async with httpx.AsyncClient(base_url=node.url, timeout=10.0) as prober, trio.open_nursery() as polling:
        polling.start_soon(poll_healthz, prober, seen, done)
        for _ in range(20):
            record = await emit(http, "worst.go", {"x": -1})
            assert record["run_ids"] == []  # evaluated (false), not refused
            await trio.sleep(0.005)
        done.set()
    event = (await http.get(f"/v1/events/{record['event_id']}")).json()
    assert event["filtered"][0]["code"] is None and "was false" in event["filtered"][0]["reason"]
    print(f"worst accepted ({len(worst)} chars): {len(seen)} /healthz answers, max {max(seen) * 1000:.1f} ms")
    assert len(seen) >= 10 and max(seen) < HEALTHZ_BOUND_S, sorted(seen)[-3:]


async def test_an_event_that_makes_a_filter_too_costly_is_recorded_and_starts_no_run(
    node: Node, http: httpx.AsyncClient
) -> None:
    resp = await register(http, {
        "id": "carts", "triggers": [{"event": "cart.updated", "expression": "event.data.items.exists(i, i.sku == 'x')"}],
    })
    assert resp.status_code in (200, 201), resp.text
    assert len((await emit(http, "cart.updated", {"items": [{"sku": "a"}, {"sku": "x"}]}))["run_ids"]) == 1
    seen: list[float] = []
    done = trio.Event()
    # The poller's own nursery: it ends (its last GET answered) before the
    # prober's connections are closed.
    async with httpx.AsyncClient(base_url=node.url, timeout=10.0) as prober, trio.open_nursery() as polling:
        polling.start_soon(poll_healthz, prober, seen, done)
        for _ in range(5):  # 50,001 items (0.7 MB): reading them all would hold the thread ~0.2 s
            record = await emit(http, "cart.updated", {"items": [{"sku": "a"}] * 50_000 + [{"sku": "x"}]})
            assert record["run_ids"] == []
        done.set()
    (note,) = (await http.get(f"/v1/events/{record['event_id']}")).json()["filtered"]
    assert note["code"] == "EXPRESSION_BUDGET_EXCEEDED" and note["error"] is True
    assert "limits.expression_budget_us" in note["reason"]
    print(f"filter over budget: {len(seen)} /healthz answers, max {max(seen) * 1000:.1f} ms")
    assert max(seen) < HEALTHZ_BOUND_S, sorted(seen)[-3:]
