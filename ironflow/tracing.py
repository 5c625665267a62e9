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

import functools
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


@functools.lru_cache(maxsize=4096)
def context_of(traceparent: str | None) -> Context | None:
    """The context a W3C ``traceparent`` names, None without one (or a bad one).
    Memoised: a run's segments and commits parse one string again and again."""
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


def in_span() -> bool:
    """Whether a span with a valid context is current in this task (cheap: no
    ``traceparent`` is formatted)."""
    return trace.get_current_span().get_span_context().is_valid


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


# The service name spans carry when OTEL_SERVICE_NAME does not say.
DEFAULT_SERVICE = "ironflow"


def configure_from_env(service: str = DEFAULT_SERVICE) -> str | None:
    """Install the OpenTelemetry SDK's TracerProvider as the standard
    ``OTEL_TRACES_EXPORTER`` variable asks (``otlp``, ``console``, or ``none``:
    spans made, none exported), unless one is installed already. Returns what
    it did, for a log line, or None when nothing was asked.

    ``otlp`` sends OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default
    ``http://localhost:4318``). Needs the ``otel`` extra; without it the
    returned text says so and tracing stays off."""
    import os

    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not wanted or enabled():
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        return f"OTEL_TRACES_EXPORTER={wanted} but the OpenTelemetry SDK is not installed (pip install 'ironflow-py[otel]'): tracing off"
    name = os.environ.get("OTEL_SERVICE_NAME", service)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if wanted == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif wanted == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            return "OTEL_TRACES_EXPORTER=otlp but the OTLP exporter is not installed (pip install 'ironflow-py[otel]'): tracing off"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif wanted != "none":
        return f"OTEL_TRACES_EXPORTER={wanted} is not one of otlp, console, none: tracing off"
    trace.set_tracer_provider(provider)
    return f"tracing on: service {name}, exporter {wanted}"
