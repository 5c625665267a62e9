"""A definition's expressions (ironflow/definitions.py): refused at
registration with the field and place named, and at the SDK's decorator;
bad ``cancel_on`` input refused on both sides."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest

import ironflow
from actors.session import RegistrationRefused, check_register
from ironflow.config import Limits
from ironflow.definitions import DefinitionRefused, compile_definition, start_verdict
from ironflow.protocol import CancelOn, Concurrency, FunctionDef, Register, Trigger


def refusal(fd: FunctionDef) -> str:
    with pytest.raises(RegistrationRefused) as info:
        check_register(Register(worker_id="w", functions=[fd]), Limits())
    return str(info.value)


def test_registration_refuses_a_bad_expression_naming_field_line_and_column() -> None:
    bad_filter = FunctionDef(id="f", triggers=[Trigger("a"), Trigger("b", "event.data.x >")])
    assert refusal(bad_filter).startswith(
        "function 'f': triggers[1].expression: expression 'event.data.x >' at line 1, column 15:"
    )
    assert "unknown variable 'order'" in refusal(
        FunctionDef(id="f", triggers=[Trigger("a", "order.amount > 1")])
    )
    listed = FunctionDef(id="f", concurrency=Concurrency(1, "[event.name]"))
    assert "concurrency.key" in refusal(listed) and "gives a list" in refusal(listed)
    assert "concurrency.key" in refusal(FunctionDef(id="f", concurrency=Concurrency(1, "a +")))
    cancel = FunctionDef(id="f", cancel_on=[CancelOn("x", expression="async.data == ")])
    assert "cancel_on[0].expression" in refusal(cancel) and "line 1" in refusal(cancel)


def test_registration_refuses_a_bad_cancel_on() -> None:
    assert "exact event name" in refusal(FunctionDef(id="f", cancel_on=[CancelOn("user.*")]))
    assert "not a dotted path" in refusal(FunctionDef(id="f", cancel_on=[CancelOn("u", match="a b")]))
    twice = FunctionDef(id="f", cancel_on=[CancelOn("u", "data.id"), CancelOn("u", "data.id")])
    assert "declared twice" in refusal(twice)
    # A cancel_on without an event never decodes (the engine's edge: 422 / refused frame).
    with pytest.raises(msgspec.ValidationError, match="missing required field `event`"):
        msgspec.json.decode(b'{"id": "f", "cancel_on": [{"match": "data.id"}]}', type=FunctionDef)
    with pytest.raises(msgspec.ValidationError, match="cancel_on"):
        msgspec.convert({"id": "f", "cancel_on": [{"event": "u"}] * 17}, FunctionDef)


def test_a_good_definition_compiles_and_judges_events() -> None:
    compiled = compile_definition(FunctionDef(
        id="f", triggers=[Trigger("order.*", "event.data.amount > 100")],
        concurrency=Concurrency(2, "event.data.region"),
        cancel_on=[CancelOn("order.cancelled", "data.id", "async.data.id == event.data.id")],
    ))
    assert start_verdict(compiled, "order.created", {"amount": 101}, "e") == (True, None, None)
    assert start_verdict(compiled, "order.created", {"amount": 1}, "e")[:1] == (False,)
    with pytest.raises(DefinitionRefused):
        compile_definition(FunctionDef(id="f", triggers=[Trigger("a", "1 +")]))


def test_the_sdk_refuses_bad_filters_and_cancel_on_at_the_decorator() -> None:
    async def handler(ctx: object) -> None:
        return None

    with pytest.raises(ValueError, match=r"triggers\[0\].expression.*line 1, column"):
        ironflow.function(triggers=[ironflow.event("a", expression="event.data.x >")])(handler)
    with pytest.raises(TypeError, match="CEL string"):
        ironflow.event("a", expression=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs an event name"):
        ironflow.CancelOn(event="")
    with pytest.raises(TypeError):
        ironflow.CancelOn(match="data.id")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="needs an event"):
        ironflow.function(cancel_on=[{"match": "data.id"}])(handler)
    with pytest.raises(ValueError, match="exact event name"):
        ironflow.function(cancel_on=[ironflow.CancelOn("user.*")])(handler)
    f = ironflow.function(
        triggers=[ironflow.event("order.created", expression="event.data.amount > 100")],
        cancel_on=[ironflow.CancelOn("order.cancelled", match="data.id", timeout=timedelta(hours=1))],
    )(handler)
    assert f.definition.triggers[0].expression == "event.data.amount > 100"
    assert f.definition.cancel_on == [CancelOn("order.cancelled", "data.id", None, 3600.0)]
