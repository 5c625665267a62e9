"""Fuzzed expressions and step outputs against a real node process: an
expression is accepted (201) or refused with its reason (422), never a 5xx;
an emit it judges is answered within a bound whatever the event; step
outputs of every size up to past the frame limit are answered (stored,
refused as stale, or 413) without closing anything; and the node is
unharmed at the end (alive, no actor restarted, honest work done)."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from tests.integration.fuzz_target import Target, assert_node_unharmed, fuzz_settings, metric

EXPRESSION_EXAMPLES = 60
OUTPUT_EXAMPLES = 12
# An emit's answer, whatever filter judged it: far above a budgeted evaluation
# (1 ms), far below the seconds an unbounded one took.
EMIT_BOUND_S = 0.5

_MACROS = ["exists", "all", "exists_one", "map", "filter"]


@st.composite
def expression(draw: st.DrawFn, depth: int = 0) -> str:
    """CEL over ``event`` with comprehensions, nesting and concatenation."""
    leaves = [
        "event.data.x == 1", "has(event.data.l)", "event.name.startsWith('f')",
        "size(event.data.s + event.data.s) > 3", "event.data.s.matches('a+b')", "1 in event.data.l",
    ]
    kind = draw(st.sampled_from(["leaf", "and", "comp", "paren"] if depth < 4 else ["leaf"]))
    if kind == "leaf":
        return draw(st.sampled_from(leaves))
    if kind == "and":
        return f"({draw(expression(depth + 1))}) {draw(st.sampled_from(['&&', '||']))} ({draw(expression(depth + 1))})"
    if kind == "paren":
        return "(" * draw(st.integers(1, 40)) + "true" + ")" * draw(st.integers(1, 40)) + " && true"
    macro = draw(st.sampled_from(_MACROS))
    source = draw(st.sampled_from(["event.data.l", "[" + ",".join(map(str, range(draw(st.integers(1, 300))))) + "]"]))
    var = f"v{depth}"
    body = draw(expression(depth + 1))
    if macro in ("map", "filter"):
        return f"{source}.{macro}({var}, {body}).size() >= 0"
    return f"{source}.{macro}({var}, {body})"


@st.composite
def event_data(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.sampled_from([0, 3, 300, 20_000]))
    return {
        "x": draw(st.integers(0, 2)),
        "l": list(range(n)),
        "s": "a" * draw(st.sampled_from([0, 10, 100_000])),
    }


def test_fuzzed_expressions_are_accepted_or_refused_and_no_emit_stalls(fuzz_target: Target) -> None:
    t = fuzz_target
    restarts_before = metric(t, "ironflow_actor_restarts_total")
    slowest: list[float] = []

    @fuzz_settings(EXPRESSION_EXAMPLES)
    @given(source=expression(), data=event_data())
    def check(source: str, data: dict[str, object]) -> None:
        fn = {"id": "fuzz-filter", "triggers": [{"event": "fuzz.filter", "expression": source}]}
        resp = t.http.post(
            "/v1/worker/register", json={"type": "register", "worker_id": "fuzz-expr", "functions": [fn]}
        )
        assert resp.status_code in (201, 422), (source, resp.status_code, resp.text[:300])
        if resp.status_code == 422:
            assert "expression" in resp.json()["message"], resp.text
            return
        started = time.perf_counter()
        emitted = t.http.post("/v1/events", json={"name": "fuzz.filter", "data": data})
        took = time.perf_counter() - started
        assert emitted.status_code in (200, 201), emitted.text[:300]
        slowest.append(took)
        assert took < EMIT_BOUND_S, (source, took)

    check()
    print(f"accepted {len(slowest)} of {EXPRESSION_EXAMPLES}, slowest emit {max(slowest, default=0) * 1000:.1f} ms")
    assert len(slowest) >= EXPRESSION_EXAMPLES // 4  # the examples reach evaluation, not only refusal
    assert_node_unharmed(t, restarts_before)


def test_fuzzed_step_outputs_up_to_past_the_frame_limit_get_an_answer(fuzz_target: Target) -> None:
    t = fuzz_target
    restarts_before = metric(t, "ironflow_actor_restarts_total")
    headers = {"Ironflow-Session-Secret": t.secret, "content-type": "application/json"}

    @fuzz_settings(OUTPUT_EXAMPLES)
    @given(size=st.sampled_from([0, 1, 300 * 1024, 4 * 1024 * 1024 - 200, 4 * 1024 * 1024 + 10, 9 * 1024 * 1024]))
    def check(size: int) -> None:
        body = (
            '{"type": "step_completed", "job_id": "j", "run_id": "run_x", "execution_seq": 1,'
            ' "lease_token": "t", "step_id": "run_x:s:0", "name": "s", "output": "' + "o" * size + '"}'
        )
        resp = t.http.post(f"/v1/worker/sessions/{t.session_id}/steps", content=body, headers=headers)
        assert resp.status_code in (404, 409, 413), (size, resp.status_code, resp.text[:300])
        assert resp.json()["code"], resp.text[:300]

    check()
    assert_node_unharmed(t, restarts_before)
