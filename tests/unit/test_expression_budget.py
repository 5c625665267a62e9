"""Expression bounds (ironflow/expressions.py): size, nesting and
comprehension depth refused at compile with the limit and the place; each
evaluation's estimated cost checked on the event before it runs; the library
handed only the part of the event the expression reads, with the same result
as the whole event."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ironflow import expressions
from ironflow.expressions import (
    BudgetExceeded,
    EvaluationError,
    ExpressionError,
    ExpressionLimits,
    compile_expression,
    event_variables,
)


@pytest.fixture(autouse=True)
def default_limits() -> Iterator[None]:
    expressions.configure(ExpressionLimits())
    yield
    expressions.configure(ExpressionLimits())


def literal(k: int) -> str:
    return "[" + ",".join(str(i) for i in range(k)) + "]"


def test_past_the_comprehension_depth_is_refused_naming_the_limit_and_the_place() -> None:
    nested = "event.data.x == 1"
    for i in range(3):
        nested = f"{literal(10)}.exists(a{i}, {nested})"
    with pytest.raises(ExpressionError, match="limits.expression_max_comprehension_depth") as refused:
        compile_expression(nested)
    # The third `exists(` (the innermost): its opening bracket.
    third = [i for i in range(len(nested)) if nested.startswith("exists(", i)][2]
    assert (refused.value.line, refused.value.column) == (1, third + len("exists("))
    assert "nested 3 deep" in refused.value.message
    compile_expression(f"{literal(10)}.exists(a, {literal(10)}.exists(b, event.data.x == b))")


def test_past_the_nesting_and_the_size_is_refused_naming_the_limit() -> None:
    deep = "(" * 33 + "event.data.x" + ")" * 33 + " == 1"
    with pytest.raises(ExpressionError, match=r"nesting deeper than 32 \(limits.expression_max_nesting\)") as refused:
        compile_expression(deep)
    assert refused.value.column == 33
    compile_expression("(" * 32 + "event.data.x" + ")" * 32 + " == 1")
    long = " || ".join(f"event.data.x == {i}" for i in range(200))  # 8 tokens per term
    with pytest.raises(ExpressionError, match=r"1599 tokens is over the limit of 1024 \(limits.expression_max_tokens\)"):
        compile_expression(long)


def test_an_expression_over_the_budget_on_a_small_event_is_refused_at_compile() -> None:
    with pytest.raises(ExpressionError, match=r"limits.expression_budget_us") as refused:
        compile_expression(f"{literal(60)}.map(a, {literal(60)}.map(b, a * b)).size() == event.data.x")
    assert "on a small event" in refused.value.message
    accepted = compile_expression(f"{literal(20)}.map(a, {literal(20)}.map(b, a * b)).size() == event.data.x")
    assert 0 < accepted.static_cost_us <= 1000


def test_the_limits_are_the_configured_ones() -> None:
    source = f"{literal(10)}.exists(a, event.data.x == a)"
    compile_expression(source)
    expressions.configure(ExpressionLimits(max_comprehension_depth=1, max_tokens=10))
    with pytest.raises(ExpressionError, match="over the limit of 10"):
        compile_expression(source)  # compiled again under the new limits, not served from the cache
    expressions.configure(ExpressionLimits(budget_us=50))
    with pytest.raises(ExpressionError, match="budget of 50 µs"):
        compile_expression(source)


def test_an_evaluation_over_the_budget_on_this_event_is_not_run() -> None:
    f = compile_expression("event.data.items.exists(i, i.sku == 'x')")
    small = [{"sku": "a"}] * 20 + [{"sku": "x"}]
    assert f.test(event_variables("e", {"items": small})) is True
    big = [{"sku": "a"}] * 5000
    started = time.perf_counter()
    with pytest.raises(BudgetExceeded, match="EXPRESSION_BUDGET_EXCEEDED: it reads more than") as over:
        f.test(event_variables("e", {"items": big}))
    assert isinstance(over.value, EvaluationError) and over.value.code == "EXPRESSION_BUDGET_EXCEEDED"
    # Counting the event stops at the budget: refusing 10,000 values reads a few hundred.
    assert time.perf_counter() - started < 0.05
    # A field the expression does not read costs nothing, however big.
    unrelated = {"items": small, "blob": [{"k": i} for i in range(20000)], "text": "x" * 3_000_000}
    assert f.test(event_variables("e", unrelated)) is True


def test_quadratic_and_concatenating_work_counts_against_the_budget() -> None:
    grows = compile_expression("event.data.l.filter(a, a > 0).size() > 0")
    assert grows.test(event_variables("e", {"l": list(range(50))})) is True
    with pytest.raises(BudgetExceeded, match="estimated"):
        grows.test(event_variables("e", {"l": list(range(300))}))  # 300 values fit, 300² copies do not
    concat = compile_expression(" + ".join(["event.data.s"] * 20) + " == ''")
    assert concat.test(event_variables("e", {"s": "ab"})) is False
    with pytest.raises(BudgetExceeded, match="estimated"):
        concat.test(event_variables("e", {"s": "a" * 200_000}))
    scan = compile_expression("event.data.s.matches('b+$')")
    assert scan.test(event_variables("e", {"s": "a" * 100_000})) is False
    with pytest.raises(BudgetExceeded):
        scan.test(event_variables("e", {"s": "a" * 4_000_000}))


# Expressions over every form of read the pruning must keep exact.
EQUIVALENT = [
    "event.data.x == 1",
    "has(event.data.x)",
    "has(event.data.m.y)",
    "event.data['x'] == 1",
    "event.data.m.y > 2 || event.data.x == 1",
    "size(event.data) > 2",
    "event.data.l.exists(v, v == 3)",
    "event.data.l[0] == 0",
    "event.data.l.map(v, v * 2).size() == 5",
    "event.data.m.exists(k, k == 'y')",
    "event.data.l.all(event, event >= 0)",  # a comprehension variable shadowing the root
    "event.name.startsWith('order') && event.id != ''",
    "event.data.m == {'y': 3}",
    "'y' in event.data.m",
    "event.data.s + event.data.s == 'abab'",
    "event.data.missing.y == 1",
    "event.data.x.y == 1",
    "event.data.l[event.data.x] == 1",
]


def events() -> Iterator[dict[str, Any]]:
    rng = random.Random(7)
    for _ in range(40):
        data: dict[str, Any] = {}
        for field, make in [
            ("x", lambda: rng.choice([0, 1, "1", None, 2.5])),
            ("m", lambda: rng.choice([{"y": 3}, {"y": 1, "z": [1]}, {}, 4, [1, 2]])),
            ("l", lambda: rng.choice([list(range(5)), [], ["a"], {"a": 1}])),
            ("s", lambda: rng.choice(["ab", "", 3])),
            ("other", lambda: [1, {"deep": [2, 3]}]),
        ]:
            if rng.random() < 0.8:
                data[field] = make()
        yield event_variables(rng.choice(["order.created", "x"]), data, "evt_1")


def outcome(run: Any) -> Any:
    try:
        return ("value", run())
    except Exception as exc:  # the library's own error, whichever it is
        return ("error", str(exc))


@pytest.mark.parametrize("source", EQUIVALENT)
def test_the_pruned_event_gives_what_the_whole_event_gives(source: str) -> None:
    cel = expressions._cel()
    whole = cel.compile(source)
    f = compile_expression(source)
    for variables in events():
        ours = outcome(lambda v=variables: f.evaluate(v))  # type: ignore[misc]
        theirs = outcome(lambda v=variables: whole.execute(dict(v)))  # type: ignore[misc]
        assert ours[0] == theirs[0], (source, variables, ours, theirs)
        if ours[0] == "value":
            assert ours == theirs, (source, variables)
        else:
            assert theirs[1].split(". ", 1)[0].strip("'") in ours[1], (source, variables, ours, theirs)
