"""``ironflow.RateLimit``, ``Debounce``, ``Singleton``, ``Batch``: ingest-side
flow control as a function declares it (docs/flow-control.md).

Each builds the wire definition (ironflow/protocol/flow.py), taking a
duration as seconds, a ``timedelta`` or a string (``"500ms"``, ``"10s"``,
``"10m"``, ``"1d"``) and refusing a bad value at once with a ValueError or
TypeError naming the field. A key is an expression over the event (a dotted
path such as ``"event.data.user_id"`` or CEL); it is compiled here when the
expression language is installed, and always by the engine at registration.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import msgspec

from ironflow.config import ConfigError, parse_duration
from ironflow.protocol import flow as wire

Duration = float | int | timedelta | str


def _seconds(value: Duration, field: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"{field} must be seconds, a timedelta or a duration string, got {value!r}")
    try:
        return parse_duration(value, field)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _built(kind: type[Any], what: str, **fields: Any) -> Any:
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _key(key: str | None, what: str) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"{what}.key must be an expression string, got {key!r}")
    try:
        from ironflow.expressions import compile_key

        compile_key(key)
    except RuntimeError:
        pass  # the light install: the engine compiles it at registration
    except ValueError as exc:
        raise ValueError(f"{what}.key: {exc}") from None
    return key


def RateLimit(limit: int, period: Duration, key: str | None = None) -> wire.RateLimit:
    """At most ``limit`` events per ``period`` (per ``key``) start a run; the
    rest are skipped and recorded on the event ("one welcome email per user
    per day": ``RateLimit(1, "1d", key="event.data.user_id")``)."""
    return _built(
        wire.RateLimit, "RateLimit", limit=limit, period_s=_seconds(period, "RateLimit.period"),
        key=_key(key, "RateLimit"),
    )


def Debounce(
    period: Duration, key: str | None = None, max_wait: Duration | None = None
) -> wire.Debounce:
    """One run ``period`` (at least 1 s) after the last event of its key, with
    that event's data; ``max_wait`` bounds the delay from the first event."""
    period_s = _seconds(period, "Debounce.period")
    max_wait_s = None if max_wait is None else _seconds(max_wait, "Debounce.max_wait")
    if max_wait_s is not None and max_wait_s < period_s:
        raise ValueError(f"Debounce.max_wait={max_wait_s:g}s is shorter than its period={period_s:g}s")
    return _built(
        wire.Debounce, "Debounce", period_s=period_s, key=_key(key, "Debounce"),
        max_wait_s=max_wait_s,
    )


def Singleton(key: str | None = None, mode: Literal["skip", "cancel"] = "skip") -> wire.Singleton:
    """At most one run per key in flight (sleeping and waiting ones count):
    ``mode="skip"`` starts no new run, ``"cancel"`` cancels the running one."""
    return _built(wire.Singleton, "Singleton", key=_key(key, "Singleton"), mode=mode)


def Batch(max_size: int = 100, timeout: Duration = 5.0, key: str | None = None) -> wire.Batch:
    """One run receives up to ``max_size`` events of its key (``ctx.events``),
    collected for at most ``timeout`` after the first."""
    return _built(
        wire.Batch, "Batch", max_size=max_size, timeout_s=_seconds(timeout, "Batch.timeout"),
        key=_key(key, "Batch"),
    )
