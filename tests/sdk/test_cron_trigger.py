"""``ironflow.cron``: declaration errors name the field; the tick arithmetic
(ironflow/protocol/cron.py) the SDK and the engine share."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import pytest

import ironflow
from ironflow.protocol import Trigger
from ironflow.protocol.cron import latest_tick, next_tick, ticks_between


def test_cron_builds_a_trigger_that_an_event_trigger_encodes_as_before() -> None:
    t = ironflow.cron("0 3 * * *", timezone="Europe/Paris", catchup="all", catchup_window=timedelta(hours=2))
    assert (t.cron, t.timezone, t.catchup, t.catchup_window_s, t.event) == (
        "0 3 * * *", "Europe/Paris", "all", 7200.0, None,
    )
    assert msgspec.json.encode(ironflow.event("a.b")) == b'{"event":"a.b"}'


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"schedule": "* * * * * * *"}, "7 fields"),
        ({"schedule": "* *"}, "2 fields"),
        ({"schedule": "0 3 * * *", "timezone": "Europe/Atlantis"}, "Europe/Atlantis"),
        ({"schedule": "0 3 * * *", "catchup": "sometimes"}, "$.catchup"),
        ({"schedule": "0 3 * * *", "catchup_window": 0}, "$.catchup_window_s"),
        ({"schedule": "99 * * * *"}, "is not valid"),
    ],
)
def test_a_bad_cron_is_a_value_error_at_declaration(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match="ironflow.cron") as info:
        ironflow.cron(**kwargs)
    assert named in str(info.value)


def test_the_decorator_refuses_a_trigger_with_neither_or_both() -> None:
    async def handler(ctx: Any) -> None:
        return None

    for trigger in (Trigger(), Trigger(event="a", cron="* * * * *"), Trigger(event="a", timezone="Europe/Paris")):
        with pytest.raises(ValueError, match=r"triggers\[0\]"):
            ironflow.function(id="f", triggers=[trigger])(handler)


def test_six_fields_put_the_seconds_first() -> None:
    start = datetime(2026, 1, 1, tzinfo=ZoneInfo("UTC")).timestamp()
    assert next_tick("*/2 * * * * *", "UTC", start) == start + 2
    assert next_tick("*/2 * * * * *", "UTC", start + 0.5) == start + 2
    assert latest_tick("*/2 * * * * *", "UTC", start + 1.9) == start
    assert ticks_between("*/2 * * * * *", "UTC", start, start + 10, 100) == [start + 2 * i for i in range(6)]
    assert ticks_between("*/2 * * * * *", "UTC", start, start + 10, 2) == [start + 8, start + 10]
    assert next_tick("0 3 * * *", "UTC", start) == start + 3 * 3600


def test_dst_spring_forward_and_fall_back_in_europe_paris() -> None:
    paris = ZoneInfo("Europe/Paris")
    day_before = datetime(2026, 3, 28, 12, tzinfo=paris).timestamp()
    spring = next_tick("30 2 * * *", "Europe/Paris", day_before)
    assert datetime.fromtimestamp(spring, paris).isoformat() == "2026-03-29T03:00:00+02:00"
    after = next_tick("30 2 * * *", "Europe/Paris", spring)
    assert datetime.fromtimestamp(after, paris).isoformat() == "2026-03-30T02:30:00+02:00"
    fall_eve = datetime(2026, 10, 24, 12, tzinfo=paris).timestamp()
    fall = ticks_between("30 2 * * *", "Europe/Paris", fall_eve, fall_eve + 2 * 86400, 10)
    assert [datetime.fromtimestamp(t, paris).isoformat() for t in fall] == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00",
    ]


def test_a_schedule_on_every_hour_follows_elapsed_time_through_both_dst_changes() -> None:
    """``*/30 * * * *`` (docs/schedules.md, "DST"): every 30 minutes of elapsed
    time through the skipped hour and through the repeated one, none twice."""
    paris = ZoneInfo("Europe/Paris")

    def wall(ticks: list[float]) -> list[str]:
        return [datetime.fromtimestamp(t, paris).isoformat()[11:] for t in ticks]

    spring = datetime(2027, 3, 28, 1, 0, tzinfo=paris).timestamp()
    sprung = ticks_between("*/30 * * * *", "Europe/Paris", spring, spring + 2 * 3600, 10)
    assert wall(sprung) == ["01:00:00+01:00", "01:30:00+01:00", "03:00:00+02:00", "03:30:00+02:00", "04:00:00+02:00"]
    fall = datetime(2027, 10, 31, 1, 30, tzinfo=paris).timestamp()
    fell = ticks_between("*/30 * * * *", "Europe/Paris", fall, fall + 3 * 3600, 10)
    assert wall(fell) == [
        "01:30:00+02:00", "02:00:00+02:00", "02:30:00+02:00",
        "02:00:00+01:00", "02:30:00+01:00", "03:00:00+01:00", "03:30:00+01:00",
    ]
    for ticks in (sprung, fell):
        assert [b - a for a, b in zip(ticks, ticks[1:], strict=False)] == [1800.0] * (len(ticks) - 1)
