"""OpenTelemetry traces: one trace per run, linked to the producer's.

Only the OpenTelemetry *API* is a dependency: until an SDK is configured
(``pip install 'ironflow-py[otel]'`` and a ``TracerProvider`` set, e.g. by
``opentelemetry-instrument`` or the application), every span here is a no-op
that costs a function call or two.

How a run becomes one trace:

- ``POST /v1/events`` starts an ``ironflow.ingest`` span, a child of the
  producer's W3C ``traceparent`` (the request header, or the body's
  ``traceparent`` field, which ``client.send(...)`` fills from the current
  span); the event is stored with that span's ``traceparent``
  (``events.traceparent``);
- every assignment of the run carries it (``EventInfo.traceparent``): the
  node's ``ironflow.dispatch`` and ``ironflow.commit`` spans, and the worker's
  ``ironflow.segment`` and ``ironflow.step`` spans, are its descendants.

With no SDK and no producer ``traceparent`` the event stores none and
nothing else is done. With no SDK but a producer ``traceparent``, the
producer's own context is carried (the run's spans, if the worker exports
any, still join the producer's trace).

This module imports nothing of ours: the worker SDK uses it too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["SpanKind", "context_of", "span", "start_span", "traceparent_of"]

_PROPAGATOR = TraceContextTextMapPropagator()
# The provider the cached tracer came from, and the tracer.
_cached: tuple[object, trace.Tracer] | None = None


def _tracer() -> trace.Tracer:
    """Ironflow's tracer from the current provider (set by the application,
    possibly after import; tests set and reset theirs)."""
    global _cached
    provider = trace.get_tracer_provider()
    if _cached is None or _cached[0] is not provider:
        _cached = (provider, provider.get_tracer("ironflow"))
    return _cached[1]


def context_of(traceparent: str | None) -> Context | None:
    """The context a W3C ``traceparent`` names, None without one (or a bad one)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(current: Span) -> str | None:
    """``current``'s W3C ``traceparent``, None when it has no valid context."""
    if not current.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(current))
    return carrier.get("traceparent")


def current_traceparent() -> str | None:
    """The ``traceparent`` of the span current in this task, None if none is."""
    return traceparent_of(trace.get_current_span())


def enabled() -> bool:
    """Whether an SDK records spans (a no-op provider makes none)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@contextmanager
def span(
    name: str,
    traceparent: str | None,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Iterator[Span]:
    """A span ``name``, child of ``traceparent`` (a new trace without one), current inside."""
    with _tracer().start_as_current_span(
        name, context=context_of(traceparent), kind=kind, attributes=dict(attributes or {})
    ) as current:
        yield current


def start_span(
    name: str,
    traceparent: str | None,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    start_time: int | None = None,
) -> Span:
    """A span ``name`` (child of ``traceparent``) started at ``start_time`` (ns
    since the epoch; now by default), not made current: the caller ends it."""
    return _tracer().start_span(
        name, context=context_of(traceparent), kind=kind, attributes=dict(attributes or {}),
        start_time=start_time,
    )
