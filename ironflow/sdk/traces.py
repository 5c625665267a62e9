"""The worker's spans (``ironflow/tracing.py``): one per segment, one per step.

``ironflow.segment`` is a child of the run's trace context, which every
assignment carries (``EventInfo.traceparent``: the engine's ingest span, under
the producer's); ``ironflow.step`` is a child of its segment's (the current
span while the handler runs: Trio hands the context down to the tasks and
threads a step runs in). A memoised step is replayed, not run: no span.

With no OpenTelemetry SDK configured and no trace in the assignment, neither
does anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ironflow.protocol import JobAssignment
from ironflow.tracing import SpanKind, configure_from_env, enabled, in_span, span


@contextlib.contextmanager
def segment_span(a: JobAssignment) -> Iterator[None]:
    """The ``ironflow.segment`` span of one assignment, current inside."""
    if a.event.traceparent is None and not enabled():
        yield
        return
    with span(
        "ironflow.segment",
        a.event.traceparent,
        {
            "ironflow.run_id": a.run_id,
            "ironflow.function_id": a.function_id,
            "ironflow.execution_seq": a.execution_seq,
            "ironflow.attempt": a.attempt,
        },
        kind=SpanKind.CONSUMER,
    ):
        yield


@contextlib.contextmanager
def step_span(a: JobAssignment, step_id: str, name: str) -> Iterator[None]:
    """The ``ironflow.step`` span of one step.run body, current inside."""
    if a.event.traceparent is None and not enabled():
        yield
        return
    with span(
        "ironflow.step", None if in_span() else a.event.traceparent,
        {"ironflow.run_id": a.run_id, "ironflow.step_id": step_id, "ironflow.step.name": name},
    ):
        yield


def configure() -> None:
    """Set up the OpenTelemetry SDK from ``OTEL_TRACES_EXPORTER`` (see
    :func:`ironflow.tracing.configure_from_env`) unless the application did."""
    configure_from_env("ironflow-worker")
