"""OpenTelemetry traces of a run: a real node and an SDK worker in-process,
spans collected by the OpenTelemetry SDK's in-memory exporter.

A producer span sends the event with ``client.send`` (which carries its W3C
``traceparent``); the run's spans — the node's ``ironflow.ingest``,
``ironflow.dispatch`` (one per segment) and ``ironflow.commit``, the worker's
``ironflow.segment`` and ``ironflow.step`` — are all in the producer's
trace: producer → ingest → segments → steps. The event keeps the ingest
span's ``traceparent`` for every later segment.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import ironflow
from ironflow import tracing
from ironflow.node import Node
from tests.integration.helpers import wait_for_run
from tests.integration.procs import db_rows


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """A TracerProvider exporting to memory for this test, the default one after it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _set_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        _set_provider(None)


def _set_provider(provider: TracerProvider | None) -> None:
    # The API lets a process set its provider once; a test sets and resets
    # its own (the OpenTelemetry test utilities do the same).
    trace._TRACER_PROVIDER_SET_ONCE._done = False  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    if provider is not None:
        trace.set_tracer_provider(provider)


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_a_run_with_a_sleep_is_one_trace_under_the_producers_span(
    spans: InMemorySpanExporter, node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    @ironflow.function(id="traced", triggers=[ironflow.event("traced.go")])
    async def traced(ctx: Any) -> Any:
        a = await ctx.step.run("a", lambda: 1)
        await ctx.step.sleep("nap", 0.2)
        b = await ctx.step.run("b", lambda: 2)
        return await ctx.step.run("c", lambda: a + b)

    worker = ironflow.StreamingWorker(node.url, [traced], handle_signals=False, reconnect_delay=0.1)
    await nursery.start(worker.run)
    producer_tracer = trace.get_tracer("producer")
    with producer_tracer.start_as_current_span("checkout") as producer:
        async with ironflow.Ironflow(node.url) as client:
            sent = await client.send("traced.go")  # carries the current span's traceparent
    run_id = sent.run_ids[0]
    assert (await wait_for_run(http, run_id))["run"]["status"] == "completed"
    await trio.sleep(0.1)  # the last commit span ends after the run's end is visible

    finished = spans.get_finished_spans()
    trace_id = producer.get_span_context().trace_id
    [ingest] = _by_name(finished, "ironflow.ingest")
    assert ingest.parent is not None and ingest.parent.span_id == producer.get_span_context().span_id
    dispatches = _by_name(finished, "ironflow.dispatch")
    assert [d.attributes["ironflow.execution_seq"] for d in dispatches] == [1, 2]  # type: ignore[index]
    commits = _by_name(finished, "ironflow.commit")
    assert commits, "no commit span"
    for span in [ingest, *dispatches, *commits]:
        assert span.context.trace_id == trace_id, span.name
    for span in [*dispatches, *commits]:
        assert span.parent is not None and span.parent.span_id == ingest.context.span_id
    assert all(d.attributes["ironflow.run_id"] == run_id for d in dispatches)  # type: ignore[index]
    # The worker's side: a segment span per segment (the sleep ends the
    # first), a step span per step run, each under its segment, one trace.
    segments = _by_name(finished, "ironflow.segment")
    assert sorted(g.attributes["ironflow.execution_seq"] for g in segments) == [1, 2]  # type: ignore[index]
    steps = _by_name(finished, "ironflow.step")
    assert sorted(str(t.attributes["ironflow.step.name"]) for t in steps) == ["a", "b", "c"]  # type: ignore[index]
    segment_ids = {g.context.span_id for g in segments}
    for span in [*segments, *steps]:
        assert span.context.trace_id == trace_id, span.name
    assert all(g.parent is not None and g.parent.span_id == ingest.context.span_id for g in segments)
    assert all(t.parent is not None and t.parent.span_id in segment_ids for t in steps)
    # The event keeps the ingest span's context for every segment.
    [(stored,)] = db_rows(node.config.database_url, "SELECT traceparent FROM events WHERE id = ?",
                          (sent.event_id,))
    assert stored == tracing.traceparent_of(_as_span(ingest))


async def test_an_emit_without_a_trace_stores_none_when_tracing_is_off(
    node: Node, http: httpx.AsyncClient
) -> None:
    assert not tracing.enabled()
    r = await http.post("/v1/events", json={"name": "untraced.go"})
    [(stored,)] = db_rows(node.config.database_url, "SELECT traceparent FROM events WHERE id = ?",
                          (r.json()["event_id"],))
    assert stored is None


async def test_a_bad_traceparent_in_the_body_is_a_400(node: Node, http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/events", json={"name": "x.go", "traceparent": "not-a-trace"})
    assert r.status_code == 400 and r.json()["code"] == "VALIDATION_ERROR"


def _as_span(readable: ReadableSpan) -> trace.Span:
    return trace.NonRecordingSpan(readable.context)
