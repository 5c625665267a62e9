"""The expression language (ironflow/expressions.py): compile errors with
their place, evaluation errors with their reason, keys in both forms."""

from __future__ import annotations

import pytest

from ironflow.expressions import (
    EvaluationError,
    ExpressionError,
    compile_expression,
    compile_key,
    event_variables,
    key_text,
)


def on(data: object, name: str = "order.created") -> dict[str, object]:
    return event_variables(name, data, "evt_1")


def test_a_filter_is_true_false_or_an_error_that_says_why() -> None:
    f = compile_expression("event.data.amount > 100")
    assert f.test(on({"amount": 150})) is True
    assert f.test(on({"amount": 99.5})) is False
    with pytest.raises(EvaluationError, match="no such key: amount"):
        f.test(on({}))
    with pytest.raises(EvaluationError, match="No such overload"):
        f.test(on({"amount": "lots"}))
    with pytest.raises(EvaluationError, match="gave a number, a filter must give true or false"):
        compile_expression("event.data.amount").test(on({"amount": 1}))


def test_the_event_name_and_id_are_visible() -> None:
    assert compile_expression("event.name.startsWith('order.')").test(on({}))
    assert compile_expression("event.id == 'evt_1'").test(on({}))
    assert compile_expression("has(event.data.x) || true").test(on({}))


def test_a_bad_expression_names_its_place() -> None:
    with pytest.raises(ExpressionError) as info:
        compile_expression("event.data.amount > ")
    assert (info.value.line, info.value.column) == (1, 21)
    assert "line 1, column 21" in str(info.value)
    with pytest.raises(ExpressionError, match="unknown variable 'order'"):
        compile_expression("order.amount > 1")
    with pytest.raises(ExpressionError, match="cannot be empty"):
        compile_expression("  ")
    # A second variable only where it is allowed (a cancel-on condition's ``async``).
    both = compile_expression("async.data.user == event.data.user", ("event", "async"))
    assert both.evaluate({**on({"user": 1}), "async": {"data": {"user": 1}}}) is True


def test_compiling_is_cached() -> None:
    assert compile_expression("1 + 1 == 2") is compile_expression("1 + 1 == 2")


def test_a_dotted_path_key_keeps_its_meaning() -> None:
    for source in ("customer.id", "data.customer.id", "event.data.customer.id"):
        key = compile_key(source)
        assert key.is_path
        assert key.key("e", {"customer": {"id": "c-7"}}) == "c-7"
        assert key.key("e", {"customer": {"id": 7}}) == "7"
        assert key.key("e", {}) is None  # a missing field is no key, as before


def test_an_expression_key() -> None:
    key = compile_key("event.data.region + ':' + event.data.tier")
    assert not key.is_path
    assert key.key("e", {"region": "eu", "tier": "pro"}) == "eu:pro"
    with pytest.raises(EvaluationError, match="no such key"):
        key.key("e", {"region": "eu"})
    assert compile_key("event.name").key("order.created", {}) == "order.created"


def test_a_key_is_one_value() -> None:
    with pytest.raises(ExpressionError, match="gives a list"):
        compile_key("[event.name, 'x']")
    with pytest.raises(EvaluationError, match="got a list"):
        compile_key("has(event.data.tags) ? event.data.tags : 'none'").key("e", {"tags": ["a"]})
    assert key_text(True) == "true" and key_text(1.5) == "1.5" and key_text(None) is None


def test_variables_bound_once_evaluate_like_a_mapping() -> None:
    from ironflow.expressions import bind

    bound = bind(on({"amount": 150}))
    assert compile_expression("event.data.amount > 100").test(bound) is True
    assert compile_expression("event.data.amount < 100").test(bound) is False
    with pytest.raises(EvaluationError, match="no such key: region"):
        compile_expression("event.data.region == 'eu'").test(bound)
