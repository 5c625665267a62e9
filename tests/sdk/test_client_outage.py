"""The client waits out an outage of the engine's database (ironflow/sdk/outage.py):
503/507 emits are sent again, bounded, backing off, logged; an emit that may
have been stored is sent again only with its idempotency key."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

import ironflow
from ironflow.sdk import outage
from ironflow.sdk.errors import IronflowAPIError


class FlakyEngine:
    """Answers POST /v1/events with ``refusals`` outage answers, then 201."""

    def __init__(self, refusals: int, code: str = "STORE_UNAVAILABLE", status: int = 503) -> None:
        self.refusals, self.code, self.status = refusals, code, status
        self.bodies: list[dict[str, Any]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(msgspec.json.decode(request.content))
        if len(self.bodies) <= self.refusals:
            return httpx.Response(
                self.status, headers={"retry-after": "1"},
                json={"code": self.code, "message": "PostgreSQL unavailable: connection refused"},
            )
        return httpx.Response(201, json={"event_id": "evt_1", "run_ids": ["run_1"]})


def _client(engine: FlakyEngine) -> ironflow.Ironflow:
    return ironflow.Ironflow("http://engine.test", transport=httpx.MockTransport(engine.handle))


async def test_an_emit_refused_for_an_outage_is_sent_again_with_its_key_and_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FlakyEngine(refusals=3)
    caplog.set_level(logging.WARNING, logger="ironflow.client")
    started = trio.current_time()
    async with _client(engine) as client:
        sent = await client.send("order.created", {"id": 7}, idempotency_key="order-7")
    assert sent.event_id == "evt_1"
    assert [b["idempotency_key"] for b in engine.bodies] == ["order-7"] * 4
    waited = trio.current_time() - started
    assert 1 + 2 + 4 <= waited <= (1 + 2 + 4) * (1 + outage.JITTER)  # backing off from Retry-After
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "STORE_UNAVAILABLE" in lines[0] and "again in" in lines[0]


async def test_a_full_disk_507_is_waited_out_too(autojump_clock: trio.testing.MockClock) -> None:
    engine = FlakyEngine(refusals=1, code="STORAGE_FULL", status=507)
    async with _client(engine) as client:
        assert (await client.send("x.go")).run_ids == ["run_1"]
    assert len(engine.bodies) == 2


async def test_the_retries_are_bounded(autojump_clock: trio.testing.MockClock) -> None:
    engine = FlakyEngine(refusals=100)
    async with _client(engine) as client:
        with pytest.raises(IronflowAPIError) as raised:
            await client.send("x.go", idempotency_key="k")
    assert raised.value.status == 503 and len(engine.bodies) == outage.EMIT_ATTEMPTS


async def test_an_emit_that_may_have_been_stored_is_sent_again_only_with_a_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    unkeyed = FlakyEngine(refusals=1, code="COMMIT_OUTCOME_UNKNOWN")
    async with _client(unkeyed) as client:
        with pytest.raises(IronflowAPIError):
            await client.send("x.go")
    assert len(unkeyed.bodies) == 1
    keyed = FlakyEngine(refusals=1, code="COMMIT_OUTCOME_UNKNOWN")
    async with _client(keyed) as client:
        await client.send("x.go", idempotency_key="k")
    assert len(keyed.bodies) == 2


async def test_other_errors_are_not_retried(autojump_clock: trio.testing.MockClock) -> None:
    engine = FlakyEngine(refusals=1, code="VALIDATION_ERROR", status=400)
    async with _client(engine) as client:
        with pytest.raises(IronflowAPIError):
            await client.send("x.go", idempotency_key="k")
    assert len(engine.bodies) == 1


def test_the_sync_client_waits_out_an_outage_too(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FlakyEngine(refusals=2)
    slept: list[float] = []
    monkeypatch.setattr("ironflow.sdk.client.time.sleep", slept.append)
    with ironflow.SyncClient("http://engine.test", transport=httpx.MockTransport(engine.handle)) as client:
        assert client.send("x.go").event_id == "evt_1"
    assert len(engine.bodies) == 3 and len(slept) == 2 and slept[0] >= 1
