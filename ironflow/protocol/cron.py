"""Cron triggers: the one reading of a schedule, for the SDK and the engine.

A cron trigger is ``Trigger(cron=..., timezone=..., catchup=...)``
(``ironflow/protocol/worker.py``). The expression is standard 5-field cron
(minute hour day-of-month month day-of-week) or 6 fields whose FIRST is the
second (``*/2 * * * * *`` = every 2 s). It is read by ``cronsim``, a
maintained, dependency-free cron library, in the trigger's IANA timezone
(``zoneinfo``), with Debian cron's rules on DST days, which docs/schedules.md
spells out: a fixed wall-clock time that a spring-forward skips fires once at
the next valid instant (02:30 → 03:00), one that a fall-back repeats fires
once (at its first pass); a schedule whose minute or hour field is ``*``
follows elapsed time.

Ticks are whole seconds, handled here as epoch seconds (floats) so the
engine compares them with the database clock (``ironflow_now()``).
"""

from __future__ import annotations

import math
from datetime import datetime
from functools import lru_cache
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from ironflow.protocol.worker import Trigger

__all__ = [
    "CRON_EVENT", "MAX_CATCHUP_TICKS", "trigger_problem", "next_tick", "latest_tick",
    "ticks_between", "tick_data", "shortest_interval_s",
]

# The name of the event behind every run a tick starts (its data: tick_data).
CRON_EVENT = "ironflow.cron"
# The most missed ticks ``catchup="all"`` starts at once (the latest ones):
# a 24 h window of a per-second schedule must not become 86,400 runs.
MAX_CATCHUP_TICKS = 1000


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def _fields(cron: str) -> int:
    return len(cron.split())


def trigger_problem(trigger: Trigger) -> str | None:
    """What is wrong with ``trigger`` (naming the field), or None if nothing.

    Exactly one of ``event`` / ``cron``; a cron of 5 or 6 fields that cronsim
    reads; a timezone ``zoneinfo`` knows; cron settings only on a cron trigger.
    """
    if (trigger.event is None) == (trigger.cron is None):
        return "a trigger needs exactly one of event= or cron="
    if trigger.cron is None:
        if trigger.timezone != "UTC" or trigger.catchup != "latest":
            return "timezone= and catchup= apply to cron triggers only"
        return None
    n = _fields(trigger.cron)
    if n not in (5, 6):
        return (
            f"cron {trigger.cron!r} has {n} fields: expected 5 (minute hour day month weekday)"
            " or 6 (second first)"
        )
    try:
        zone = _zone(trigger.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        return f"timezone {trigger.timezone!r} is not a known IANA timezone (e.g. 'Europe/Paris')"
    try:
        CronSim(trigger.cron, datetime(2000, 1, 1, tzinfo=zone))
    except (CronSimError, ValueError) as exc:
        return f"cron {trigger.cron!r} is not valid: {exc}"
    return None


def _at(epoch: float, timezone: str) -> datetime:
    return datetime.fromtimestamp(epoch, _zone(timezone))


def next_tick(cron: str, timezone: str, after: float) -> float:
    """The first tick of ``cron`` in ``timezone`` strictly after epoch ``after``."""
    # cronsim starts strictly after a whole second; ticks are whole seconds.
    return next(CronSim(cron, _at(math.floor(after), timezone))).timestamp()


def latest_tick(cron: str, timezone: str, at: float) -> float | None:
    """The last tick at or before epoch ``at`` (None if cronsim finds none)."""
    try:
        return next(CronSim(cron, _at(math.floor(at) + 1, timezone), reverse=True)).timestamp()
    except StopIteration:
        return None


def ticks_between(cron: str, timezone: str, start: float, end: float, limit: int) -> list[float]:
    """The ticks ``t`` with ``start <= t <= end``, oldest first: the latest
    ``limit`` of them when there are more."""
    out: list[float] = []
    for dt in CronSim(cron, _at(math.floor(end) + 1, timezone), reverse=True):
        t = dt.timestamp()
        if t < start or len(out) >= limit:
            break
        out.append(t)
    out.reverse()
    return out


def shortest_interval_s(cron: str) -> float:
    """The shortest wall-clock time between two consecutive ticks of ``cron``
    (a valid expression, :func:`trigger_problem`), from its second, minute
    and hour fields: exact within a day; across midnight as if the next day
    matched too (the day fields may make that gap longer, never shorter).
    DST transitions are not counted: the bound is on the schedule as written.
    """
    sim = CronSim(cron, datetime(2000, 1, 1))
    seconds, minutes, hours = sorted(sim.seconds), sorted(sim.minutes), sorted(sim.hours)
    # Each level: the gaps inside it, then from the last tick of one unit of
    # the level above to the first of the next unit.
    gaps = [b - a for a, b in zip(seconds, seconds[1:], strict=False)]
    in_minute = seconds[-1] - seconds[0]
    gaps += [60 * (b - a) - in_minute for a, b in zip(minutes, minutes[1:], strict=False)]
    in_hour = 60 * minutes[-1] + seconds[-1] - (60 * minutes[0] + seconds[0])
    gaps += [3600 * (b - a) - in_hour for a, b in zip(hours, hours[1:], strict=False)]
    in_day = 3600 * hours[-1] + 60 * minutes[-1] + seconds[-1] - (3600 * hours[0] + 60 * minutes[0] + seconds[0])
    gaps.append(86400 - in_day)
    return float(min(gaps))


def tick_data(cron: str, timezone: str, scheduled_at: float) -> dict[str, Any]:
    """The data of the ``ironflow.cron`` event of one tick: ``scheduled_at``
    (ISO-8601 in the schedule's timezone, with its offset),
    ``scheduled_at_epoch`` (epoch seconds), ``cron`` and ``timezone``."""
    return {
        "scheduled_at": _at(scheduled_at, timezone).isoformat(),
        "scheduled_at_epoch": scheduled_at,
        "cron": cron,
        "timezone": timezone,
    }
