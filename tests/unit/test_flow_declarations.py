"""Declaring ingest-side flow control (ironflow/sdk/flow.py): durations in
every accepted form, and bad input refused at declaration and at
registration (actors/session.py check_register), naming the field."""

from __future__ import annotations

from datetime import timedelta

import pytest

import ironflow
from actors.session import RegistrationRefused, check_register
from ironflow.config import Limits
from ironflow.protocol import (
    Concurrency,
    Debounce,
    FunctionDef,
    RateLimit,
    Register,
    Singleton,
    Trigger,
)


async def _handler(ctx):
    return None


def test_durations_are_seconds_a_timedelta_or_a_string():
    assert ironflow.RateLimit(1, "1d").period_s == 86400
    assert ironflow.RateLimit(1, timedelta(minutes=10)).period_s == 600
    assert ironflow.Debounce("2s", max_wait=3).max_wait_s == 3
    assert ironflow.Batch(10, "500ms").timeout_s == 0.5
    assert ironflow.Singleton(key="event.data.account", mode="cancel").mode == "cancel"


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: ironflow.RateLimit(0, 10), "limit"),
        (lambda: ironflow.RateLimit(1, "soon"), "RateLimit.period"),
        (lambda: ironflow.Debounce("500ms"), "period_s"),
        (lambda: ironflow.Debounce(5, max_wait=2), "max_wait"),
        (lambda: ironflow.Batch(max_size=0), "max_size"),
        (lambda: ironflow.RateLimit(1, 10, key="event.data.(("), "RateLimit.key"),
        (lambda: ironflow.Batch(key="[1, 2]"), "a list"),
        (lambda: ironflow.Singleton(mode="later"), "mode"),  # type: ignore[arg-type]
    ],
)
def test_bad_flow_control_is_refused_at_declaration_naming_the_field(build, names):
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        build()


def test_a_duration_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="RateLimit.period"):
        ironflow.RateLimit(1, [10])  # type: ignore[arg-type]


def test_mechanisms_that_decide_when_a_run_starts_cannot_be_combined():
    with pytest.raises(ValueError, match="debounce and singleton cannot be combined"):
        ironflow.function(
            id="f", triggers=["a"], debounce=ironflow.Debounce(2), singleton=ironflow.Singleton()
        )(_handler)
    fn = ironflow.function(
        id="g", triggers=["a"], rate_limit=ironflow.RateLimit(1, "1d", key="event.data.user"),
        batch=ironflow.Batch(50, 2),
    )(_handler)
    assert fn.definition.rate_limit is not None and fn.definition.batch is not None


def _register(fd: FunctionDef) -> None:
    check_register(
        Register(worker_id="w", functions=[fd], max_concurrent_jobs=1), Limits()
    )


@pytest.mark.parametrize(
    ("fd", "names"),
    [
        (FunctionDef(id="f", triggers=[Trigger("a")], rate_limit=RateLimit(1, 10, key="1 +")),
         "rate_limit.key"),
        (FunctionDef(id="f", triggers=[Trigger("a")], singleton=Singleton(key="{'a': 1}")),
         "singleton.key"),
        (FunctionDef(id="f", triggers=[Trigger("a")], debounce=Debounce(5, max_wait_s=2)),
         "max_wait"),
    ],
)
def test_a_registration_with_bad_flow_control_is_refused_naming_the_field(fd, names):
    with pytest.raises(RegistrationRefused, match=names):
        _register(fd)


@pytest.mark.parametrize(
    ("concurrency", "extra", "names"),
    [
        (ironflow.Concurrency(2, on_limit="sometimes"), {}, "on_limit"),  # type: ignore[arg-type]
        ({"on_limit": "skip"}, {}, "limit"),
        ([ironflow.Concurrency(9, on_limit="skip"), ironflow.Concurrency(1, key="k", on_limit="skip")], {},
         "at most one of the two constraints may have an on_limit"),
        (ironflow.Concurrency(1, on_limit="cancel_in_progress"), {"batch": ironflow.Batch(10, 2)},
         "concurrency.on_limit='cancel_in_progress' cannot be combined with batch"),
        ([ironflow.Concurrency(9), ironflow.Concurrency(1, key="k", on_limit="skip")],
         {"singleton": ironflow.Singleton()}, r"concurrency\[1\].on_limit='skip' cannot be combined with singleton"),
    ],
)
def test_a_bad_on_limit_is_refused_at_declaration_naming_the_field(concurrency, extra, names):
    with pytest.raises((ValueError, TypeError), match=names):
        ironflow.function(id="f", triggers=["a"], concurrency=concurrency, **extra)(_handler)


def test_a_registration_with_two_on_limits_is_refused_naming_the_field():
    fd = FunctionDef(id="f", triggers=[Trigger("a")], concurrency=[
        Concurrency(9, on_limit="cancel_in_progress"), Concurrency(1, key="k", on_limit="skip"),
    ])
    with pytest.raises(RegistrationRefused, match="on_limit"):
        _register(fd)
    ok = FunctionDef(id="f", triggers=[Trigger("a")], concurrency=Concurrency(1, on_limit="skip"))
    _register(ok)
