"""ironflow/tracing.py: W3C traceparent in and out, and the SDK set up from the environment."""

from __future__ import annotations

import os
import subprocess
import sys

from ironflow import tracing
from tests.integration.procs import ROOT

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_span_under_a_traceparent_carries_its_trace_and_none_without_an_sdk_or_parent() -> None:
    with tracing.span("x", PARENT) as span:
        # No SDK installed here: the span is the parent's context, passed on.
        assert tracing.traceparent_of(span) == PARENT
        assert tracing.current_traceparent() == PARENT
    with tracing.span("y", None) as span:
        assert tracing.traceparent_of(span) is None
    assert tracing.context_of("garbage") is None and tracing.context_of(None) is None


def _configured(env: dict[str, str]) -> list[str]:
    code = (
        "from ironflow import tracing\n"
        "print(tracing.configure_from_env('svc'))\n"
        "with tracing.span('x', None) as s:\n"
        "    print(tracing.enabled(), tracing.traceparent_of(s) is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | env,
    )
    return out.stdout.splitlines()


def test_otel_traces_exporter_none_turns_tracing_on_without_exporting() -> None:
    assert _configured({"OTEL_TRACES_EXPORTER": "none"}) == [
        "tracing on: service svc, exporter none", "True True"
    ]


def test_without_otel_traces_exporter_tracing_stays_off() -> None:
    assert _configured({}) == ["None", "False False"]


def test_an_unknown_exporter_is_refused_with_a_reason() -> None:
    first, second = _configured({"OTEL_TRACES_EXPORTER": "carrier-pigeon"})
    assert "is not one of otlp, console, none: tracing off" in first
    assert second == "False False"
