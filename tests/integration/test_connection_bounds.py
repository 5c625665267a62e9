"""Connection bounds: a client chooses how many connections it opens, how
slowly it sends and how long it waits; the node bounds each (config), and
refuses past a bound with a clear answer.

- SLOW_CLIENTS connections sending their request heads a byte a second do
  not slow ``/healthz`` or emits (p99 under P99_WITHIN_S), and each is closed
  within ``timings.http_header_timeout_s`` of its first byte;
- past ``limits.max_connections`` a connection is answered 503
  ``TOO_MANY_CONNECTIONS`` with a ``Retry-After``, and served again once
  one closes;
- past ``limits.max_held_waits`` a result request with ``wait_s`` is answered
  429 ``TOO_MANY_HELD_WAITS`` with a ``Retry-After``; one without is served.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ironflow.config import load_config
from ironflow.node import Node
from ironflow.protocol import FunctionDef, Trigger
from tests.integration.conftest import TEST_TIMINGS
from tests.integration.helpers import emit, eventually, raw_worker

# Wall-clock bounds: run alone, after the parallel phase (pyproject's markers).
pytestmark = [pytest.mark.serial]

# Connections sending their heads a byte at a time.
SLOW_CLIENTS = 500
# Seconds between two bytes of a slow client.
SLOW_BYTE_S = 1.0
# The head timeout of these tests: short, so the test runs in seconds.
HEADER_TIMEOUT_S = 3.0
# A slow connection must be closed by then after its first byte (the timer's
# wake-up and the node's thread shared with SLOW_CLIENTS readers).
CLOSED_WITHIN_S = HEADER_TIMEOUT_S + 2.0
# /healthz and emits, meanwhile, answered within this at the 99th percentile.
P99_WITHIN_S = 0.050
# Pause between two probes of /healthz, and between two emits.
PROBE_GAP_S = 0.010
EMIT_GAP_S = 0.020
# A result wait held for the cap test, and one answered soon.
HELD_WAIT_S = 3.0
SHORT_WAIT_S = 0.05
# A function whose runs never end in the cap test (its worker leaves at once).
IDLE = FunctionDef(id="idle", triggers=[Trigger("idle.go")])
# The request a slow client never finishes sending.
SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nhost: node\r\nuser-agent: a-very-slow-client\r\n\r\n"


async def _node(
    tmp_path: Path, nursery: trio.Nursery, timings: dict[str, Any], limits: dict[str, Any]
) -> Node:
    config = load_config(
        env={}, dev=True,
        overrides={"db": str(tmp_path / "ironflow.db"), "port": 0, "state_dir": str(tmp_path / "state")},
        timing_overrides={**TEST_TIMINGS, **timings}, limit_overrides=limits,
    )
    node: Node = await nursery.start(Node(config).run)
    return node


@pytest.fixture
async def slow_node(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Node]:
    node = await _node(tmp_path, nursery, {"http_header_timeout_s": HEADER_TIMEOUT_S}, {})
    yield node
    node.stop()


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _slow_client(port: int, delay: float, closed_after: list[float]) -> None:
    """Send SLOW_HEAD a byte every SLOW_BYTE_S; record how long after the
    first byte the node closed the connection."""
    await trio.sleep(delay)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    started = trio.current_time()
    try:
        for i in range(len(SLOW_HEAD)):
            try:
                await stream.send_all(SLOW_HEAD[i : i + 1])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                break
            with trio.move_on_after(SLOW_BYTE_S):
                try:
                    if await stream.receive_some(1024) == b"":
                        break  # closed by the node
                except trio.BrokenResourceError:
                    break
                raise AssertionError("the node answered a head it never got whole")
        closed_after.append(trio.current_time() - started)
    finally:
        await stream.aclose()


async def test_slow_request_heads_do_not_delay_others_and_are_closed_by_the_head_timeout(
    slow_node: Node,
) -> None:
    assert SLOW_BYTE_S * len(SLOW_HEAD) > CLOSED_WITHIN_S  # a head slower than the timeout
    closed_after: list[float] = []
    health: list[float] = []
    emits: list[float] = []
    async with httpx.AsyncClient(base_url=slow_node.url, timeout=10.0) as http:

        async def probe(path: str, gap: float, into: list[float], send: Any) -> None:
            while True:
                started = trio.current_time()
                response = await send()
                assert response.status_code in (200, 201), (path, response.text)
                into.append(trio.current_time() - started)
                await trio.sleep(gap)

        async with trio.open_nursery() as clients:
            for i in range(SLOW_CLIENTS):  # spread over a second: a byte every 2 ms
                clients.start_soon(_slow_client, slow_node.port, i * SLOW_BYTE_S / SLOW_CLIENTS, closed_after)
            async with trio.open_nursery() as probes:
                probes.start_soon(probe, "/healthz", PROBE_GAP_S, health, lambda: http.get("/healthz"))
                probes.start_soon(
                    probe, "/v1/events", EMIT_GAP_S, emits,
                    lambda: http.post("/v1/events", json={"name": "probe.go", "data": {}}),
                )
                await eventually(
                    _all_closed(closed_after), timeout=SLOW_BYTE_S + CLOSED_WITHIN_S + 5,
                    message=f"all {SLOW_CLIENTS} slow connections closed",
                )
                probes.cancel_scope.cancel()
        assert (await http.get("/healthz")).status_code == 200
        await emit(http, "probe.go")
    assert len(closed_after) == SLOW_CLIENTS
    assert min(closed_after) >= HEADER_TIMEOUT_S * 0.9, min(closed_after)
    assert max(closed_after) <= CLOSED_WITHIN_S, max(closed_after)
    assert health and emits
    assert _p99(health) < P99_WITHIN_S, f"/healthz p99 {_p99(health) * 1000:.1f} ms over {len(health)}"
    assert _p99(emits) < P99_WITHIN_S, f"emit p99 {_p99(emits) * 1000:.1f} ms over {len(emits)}"
    print(
        f"\n{SLOW_CLIENTS} slow heads: /healthz p99 {_p99(health) * 1000:.1f} ms ({len(health)}),"
        f" emit p99 {_p99(emits) * 1000:.1f} ms ({len(emits)}),"
        f" closed after {min(closed_after):.2f}-{max(closed_after):.2f} s"
    )


def _all_closed(closed_after: list[float]) -> Any:
    async def check() -> bool:
        return len(closed_after) >= SLOW_CLIENTS

    return check


async def test_a_connection_past_the_cap_is_answered_503_and_served_once_one_closes(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    cap = 4
    node = await _node(tmp_path, nursery, {}, {"max_connections": cap})
    held = [await trio.open_tcp_stream("127.0.0.1", node.port) for _ in range(cap)]
    try:
        async with httpx.AsyncClient(base_url=node.url, timeout=5.0) as http:
            refused = await http.get("/healthz")
            assert refused.status_code == 503
            assert refused.json()["code"] == "TOO_MANY_CONNECTIONS"
            assert "limits.max_connections" in refused.json()["message"]
            assert int(refused.headers["retry-after"]) >= 1
            await held.pop().aclose()

            async def served() -> bool:
                async with httpx.AsyncClient(base_url=node.url, timeout=5.0) as fresh:
                    return (await fresh.get("/healthz")).status_code == 200

            await eventually(served, timeout=5, message="served once a connection closed")
    finally:
        for stream in held:
            await stream.aclose()
        node.stop()


async def test_a_result_wait_past_the_cap_is_answered_429_and_one_without_wait_is_served(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    cap = 2
    node = await _node(tmp_path, nursery, {}, {"max_held_waits": cap})
    try:
        async with raw_worker(node.url, [IDLE]):
            pass  # registered, then gone: the run below waits for a worker to the end
        async with httpx.AsyncClient(base_url=node.url, timeout=10.0) as http:
            path = f"/v1/runs/{(await emit(http, 'idle.go'))['run_ids'][0]}/result"
            answers: list[int] = []

            async def held_wait() -> None:
                while True:  # refused while a probe below held the slot: again
                    status = (await http.get(path, params={"wait_s": HELD_WAIT_S})).status_code
                    if status != 429:
                        answers.append(status)
                        return
                    await trio.sleep(SHORT_WAIT_S)

            async def refused() -> httpx.Response | None:
                # Answered 202 after SHORT_WAIT_S until the cap's waits are held.
                r = await http.get(path, params={"wait_s": SHORT_WAIT_S})
                return r if r.status_code == 429 else None

            async with trio.open_nursery() as waits:
                for _ in range(cap):
                    waits.start_soon(held_wait)
                answer = await eventually(refused, timeout=HELD_WAIT_S / 2, message="a wait refused 429")
                assert answer.json()["code"] == "TOO_MANY_HELD_WAITS"
                assert "limits.max_held_waits" in answer.json()["message"]
                assert int(answer.headers["retry-after"]) >= 1
                assert (await http.get(path)).status_code == 202  # wait_s=0 is never held
            assert answers == [202] * cap
            # The held ones ended: room again.
            assert (await http.get(path, params={"wait_s": SHORT_WAIT_S})).status_code == 202
    finally:
        node.stop()
