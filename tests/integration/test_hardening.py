"""Hardening regressions, each through a real node (in-process, real HTTP and
websockets, both backends): session ownership, nesting depth, integer bounds,
function definitions, per-worker limits and framework errors."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio_websocket

import ironflow
from ironflow.config import Timings
from ironflow.node import Node
from ironflow.protocol import (
    MAX_JSON_DEPTH,
    SESSION_SECRET_HEADER,
    FunctionDef,
    JobAck,
    JobAssignment,
    JobCompleted,
    Refused,
    RetryPolicy,
    Trigger,
    encoder,
)
from tests.clock import skewed
from tests.integration.helpers import emit, raw_worker, wait_for_run
from tests.integration.test_bad_input import assert_node_still_works, close_of

FN = FunctionDef(id="echo", triggers=[Trigger("echo.go")])


def nested(depth: int) -> msgspec.Raw:
    """A JSON value ``depth`` arrays deep (raw: too deep for an encoder to build)."""
    return msgspec.Raw(("[" * depth + "1" + "]" * depth).encode())


async def register_pull(http: httpx.AsyncClient, functions: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"type": "register", "worker_id": "puller", "functions": functions, **extra}
    return await http.post("/v1/worker/register", json=body)


# ── 1. a session belongs to the worker that registered it ────────────────────


async def test_a_streaming_session_id_cannot_be_used_over_the_pull_endpoints(
    node: Node, http: httpx.AsyncClient
) -> None:
    async with raw_worker(node.url, [FN]) as worker:
        sid = worker.session_id
        # The attacker knows the id (capacity sessions, a run's lease) and even
        # holds a valid secret of its own pull session: none of it opens this one.
        own = (await register_pull(http, [{"id": "other", "triggers": [{"event": "other.go"}]}])).json()
        for headers in ({}, {SESSION_SECRET_HEADER: "guess"}, {SESSION_SECRET_HEADER: own["session_secret"]}):
            resp = await http.post(f"/v1/worker/sessions/{sid}/poll", json={"wait_s": 0}, headers=headers)
            assert resp.status_code == 404 and resp.json()["code"] == "SESSION_NOT_FOUND"
        run_id = (await emit(http, "echo.go", {"v": 1}))["run_ids"][0]
        job = await worker.receive_type(JobAssignment)  # the live worker still gets its work
        assert job.run_id == run_id
        # Even with the job's lease token, the attacker's ack and result are refused.
        ack = encoder.encode(JobAck(job.job_id, run_id, job.execution_seq, job.lease_token))
        resp = await http.post(f"/v1/worker/sessions/{sid}/ack", content=ack)
        assert resp.status_code == 404
        forged = JobCompleted(job.job_id, run_id, job.execution_seq, job.lease_token, output="forged")
        resp = await http.post(
            f"/v1/worker/sessions/{sid}/result",
            content=encoder.encode(forged),
            headers={SESSION_SECRET_HEADER: own["session_secret"]},
        )
        assert resp.status_code == 404
        resp = await http.delete(f"/v1/worker/sessions/{sid}")
        assert resp.status_code == 404
        # The real owner finishes the run with its own output.
        await worker.send(JobAck(job.job_id, run_id, job.execution_seq, job.lease_token))
        await worker.send(JobCompleted(job.job_id, run_id, job.execution_seq, job.lease_token, output="honest"))
        assert (await wait_for_run(http, run_id))["run"]["output"] == "honest"


async def test_a_pull_session_answers_only_calls_that_carry_its_secret(
    node: Node, http: httpx.AsyncClient
) -> None:
    reg = await register_pull(http, [{"id": "echo", "triggers": [{"event": "echo.go"}]}])
    assert reg.status_code == 201
    sid, secret = reg.json()["session_id"], reg.json()["session_secret"]
    assert secret and len(secret) >= 32
    mine = {SESSION_SECRET_HEADER: secret}
    hb = {"type": "heartbeat", "jobs": []}
    for headers in ({}, {SESSION_SECRET_HEADER: secret[:-1] + "x"}):
        assert (await http.post(f"/v1/worker/sessions/{sid}/heartbeat", json=hb, headers=headers)).status_code == 404
        assert (await http.delete(f"/v1/worker/sessions/{sid}", headers=headers)).status_code == 404
    # The refused goodbye changed nothing: the session still serves its owner.
    assert (await http.post(f"/v1/worker/sessions/{sid}/heartbeat", json=hb, headers=mine)).status_code == 200
    run_id = (await emit(http, "echo.go"))["run_ids"][0]
    polled = await http.post(f"/v1/worker/sessions/{sid}/poll", json={"wait_s": 5}, headers=mine)
    assert polled.status_code == 200 and polled.json()["jobs"][0]["run_id"] == run_id
    assert (await http.delete(f"/v1/worker/sessions/{sid}", headers=mine)).status_code == 200
    assert (await http.post(f"/v1/worker/sessions/{sid}/heartbeat", json=hb, headers=mine)).status_code == 404


async def test_the_session_secret_is_stored_hashed(node: Node, http: httpx.AsyncClient) -> None:
    secret = (await register_pull(http, [])).json()["session_secret"]
    rows = await node.store._transact(  # type: ignore[attr-defined]
        lambda tx: tx.fetchall("SELECT secret_hash FROM worker_sessions WHERE mode = 'pull'")
    )
    assert rows and all(row[0] != secret and len(row[0]) == 64 for row in rows)


# ── 2. nesting depth ───────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/events", {"name": "x", "data": nested(1000)}),
        ("/v1/events/batch", {"events": [{"name": "x", "data": nested(1000)}]}),
        ("/v1/functions/echo/invoke", {"data": nested(1000)}),
        ("/v1/worker/register", {"type": "register", "worker_id": "w", "functions": nested(1000)}),
        ("/v1/worker/sessions/nope/poll", {"wait_s": nested(1000)}),
        ("/v1/worker/sessions/nope/result", {"type": "job_completed", "output": nested(1000)}),
        ("/v1/runs/nope/cancel", {"reason": nested(1000)}),
    ],
)
async def test_json_nested_past_the_limit_is_a_400_naming_it(
    node: Node, http: httpx.AsyncClient, path: str, body: Any
) -> None:
    resp = await http.post(path, content=msgspec.json.encode(body))
    assert resp.status_code == 400
    assert f"limit of {MAX_JSON_DEPTH} levels" in resp.json()["message"]


async def test_json_at_the_depth_limit_is_accepted(node: Node, http: httpx.AsyncClient) -> None:
    # The body's own object is one level; the data fills the rest exactly.
    ok = await http.post("/v1/events", content=msgspec.json.encode({"name": "x", "data": nested(MAX_JSON_DEPTH - 1)}))
    assert ok.status_code == 201
    deep = await http.post("/v1/events", content=msgspec.json.encode({"name": "x", "data": nested(MAX_JSON_DEPTH)}))
    assert deep.status_code == 400


async def test_a_deeply_nested_frame_closes_the_socket_1007(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    frame = msgspec.json.encode({"type": "heartbeat", "jobs": nested(5000)}).decode()
    code, reason = await close_of(node, frame)
    assert code == 1007 and f"{MAX_JSON_DEPTH} levels" in (reason or "")
    await assert_node_still_works(node, http, nursery)


# ── 3. integer bounds ────────────────────────────────────────────────────────


async def test_integers_past_64_bits_are_a_400_naming_the_field(node: Node, http: httpx.AsyncClient) -> None:
    ack = {"type": "job_ack", "job_id": "j", "run_id": "r", "execution_seq": 2**63, "lease_token": "t"}
    resp = await http.post("/v1/worker/sessions/nope/ack", json=ack)
    assert resp.status_code == 400 and "execution_seq" in resp.json()["message"]
    resp = await register_pull(http, [], max_concurrent_jobs=2**31)
    assert resp.status_code == 400 and "max_concurrent_jobs" in resp.json()["message"]
    resp = await http.post("/v1/worker/sessions/nope/poll", json={"max_jobs": 2**64})
    assert resp.status_code == 400 and "max_jobs" in resp.json()["message"]
    fn = {"id": "f", "concurrency": {"limit": 2**70}}
    resp = await register_pull(http, [fn])
    assert resp.status_code == 400 and "limit" in resp.json()["message"]


async def test_an_out_of_range_frame_closes_the_socket_1007_naming_the_field(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    async with raw_worker(node.url, [FN]) as worker:
        await worker.send_raw(
            '{"type": "job_ack", "job_id": "j", "run_id": "r", "execution_seq": 99999999999999999999, "lease_token": "t"}'
        )
        refused = await worker.receive_type(Refused)
        assert refused.code == "INVALID_MESSAGE" and "execution_seq" in refused.message
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            with trio.fail_after(5):
                while True:
                    await worker.ws.get_message()
        assert closed.value.reason.code == 1007
    await assert_node_still_works(node, http, nursery)


# ── 4. function definitions ─────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("retries", "field"),
    [
        ({"max_attempts": 10**23}, "max_attempts"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"backoff_factor": 1e308}, "backoff_factor"),
        ({"max_delay_s": -1}, "max_delay_s"),
    ],
)
async def test_a_definition_out_of_bounds_is_refused_at_registration(
    node: Node, http: httpx.AsyncClient, retries: dict[str, Any], field: str
) -> None:
    fn = {"id": "bad", "triggers": [{"event": "bad.go"}], "retries": retries}
    resp = await register_pull(http, [fn])
    assert resp.status_code == 400 and field in resp.json()["message"]
    emitted = await http.post("/v1/events", json={"name": "bad.go"})
    assert emitted.status_code == 201 and emitted.json()["run_ids"] == []


async def test_a_stored_definition_refused_by_todays_bounds_never_breaks_an_emit(
    node: Node, http: httpx.AsyncClient
) -> None:
    # An older version stored this; the node must keep serving every emit.
    assert (await register_pull(http, [{"id": "good", "triggers": [{"event": "x.go"}]}])).status_code == 201
    bad = '{"id":"legacy","triggers":[{"event":"x.go"}],"retries":{"max_attempts":100000000000000000000000}}'

    def store_legacy(tx: Any) -> None:
        tx.execute(
            "INSERT INTO functions (id, definition, audit, version, updated_at) VALUES (?, ?, 0, 1, 0)",
            ("legacy", bad),
        )
        tx.execute("INSERT INTO function_triggers (pattern, function_id) VALUES ('x.go', 'legacy')")

    await node.store._transact(store_legacy)  # type: ignore[attr-defined]
    single = await http.post("/v1/events", json={"name": "x.go"})
    assert single.status_code == 201 and len(single.json()["run_ids"]) == 1
    batch = await http.post("/v1/events/batch", json={"events": [{"name": "x.go"}, {"name": "y"}]})
    assert batch.status_code == 201
    assert (await http.get("/v1/functions")).status_code == 200
    invoked = await http.post("/v1/functions/legacy/invoke", json={"data": {}})
    assert invoked.status_code == 404 and "register it again" in invoked.json()["message"]


def test_a_huge_backoff_factor_caps_at_the_max_delay_instead_of_overflowing() -> None:
    policy = RetryPolicy(max_attempts=1000, backoff_factor=100.0, max_delay_s=60.0)
    assert policy.delay_after(999) == 60.0
    assert RetryPolicy().delay_after(3) == 4.0


# ── 5. per-worker limits ─────────────────────────────────────────────────────


@pytest.fixture
def node_limits() -> dict[str, Any]:
    return {"max_slots_per_session": 20, "max_functions_per_worker": 3, "max_functions_per_trigger": 2,
            "cron_min_interval_s": 10}


@pytest.fixture
async def limited_node(database_url: str, tmp_path: Any, nursery: trio.Nursery, node_limits: dict[str, Any]) -> Any:
    from ironflow.config import load_config

    config = load_config(
        env={},
        dev=True,
        overrides={"db": database_url, "port": 0, "state_dir": str(tmp_path / "lim")},
        limit_overrides=node_limits,
    )
    started: Node = await nursery.start(Node(config).run)
    yield started
    started.stop()


def fns(*ids: str, event: str = "e.go") -> list[dict[str, Any]]:
    return [{"id": i, "triggers": [{"event": event}]} for i in ids]


async def test_registrations_past_the_limits_are_refused_with_the_setting_named(limited_node: Node) -> None:
    async with httpx.AsyncClient(base_url=limited_node.url) as http:
        resp = await register_pull(http, fns("a"), max_concurrent_jobs=21)
        assert resp.status_code == 422 and "limits.max_slots_per_session" in resp.json()["message"]
        resp = await register_pull(http, fns("a", "b", "c", "d"))
        assert resp.status_code == 422 and "limits.max_functions_per_worker" in resp.json()["message"]
        resp = await register_pull(http, fns("a", "a"))
        assert resp.status_code == 422 and "twice" in resp.json()["message"]
        assert (await register_pull(http, fns("a", "b"))).status_code == 201
        # A third function on the same trigger would make one emit start 3 runs.
        resp = await register_pull(http, fns("c"))
        assert resp.status_code == 422 and "'e.go'" in resp.json()["message"]
        # Re-registering the same two functions is fine: they are not "more".
        assert (await register_pull(http, fns("a", "b"))).status_code == 201
        emitted = (await http.post("/v1/events", json={"name": "e.go"})).json()
        assert len(emitted["run_ids"]) == 2


async def test_a_cron_firing_more_often_than_the_minimum_interval_is_refused_naming_the_limit(
    limited_node: Node,
) -> None:
    def cron(expr: str) -> list[dict[str, Any]]:
        return [{"id": "ticker", "triggers": [{"cron": expr}]}]

    async with httpx.AsyncClient(base_url=limited_node.url) as http:
        for too_often in ("* * * * * *", "*/5 * * * * *", "0,3 * * * * *"):
            resp = await register_pull(http, cron(too_often))
            assert resp.status_code == 422, resp.text
            message = resp.json()["message"]
            assert "limits.cron_min_interval_s" in message and "triggers[0]" in message
        assert (await http.get("/v1/functions", params={"all": "true"})).json()["functions"] == []
        assert (await register_pull(http, cron("*/10 * * * * *"))).status_code == 201
    async with raw_worker(limited_node.url, None, register=False) as worker:
        await worker.send_raw(
            msgspec.json.encode({"type": "register", "worker_id": "w", "functions": cron("* * * * * *")}).decode()
        )
        refused = await worker.receive_type(Refused)
        assert refused.code == "REGISTRATION_REFUSED" and "limits.cron_min_interval_s" in refused.message


async def test_a_streaming_registration_past_a_limit_gets_refused_then_1008(limited_node: Node) -> None:
    async with raw_worker(limited_node.url, None, register=False) as worker:
        await worker.send_raw(
            msgspec.json.encode({"type": "register", "worker_id": "w", "functions": [], "max_concurrent_jobs": 100}).decode()
        )
        refused = await worker.receive_type(Refused)
        assert refused.code == "REGISTRATION_REFUSED" and "max_slots_per_session" in refused.message
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            with trio.fail_after(5):
                await worker.ws.get_message()
        assert closed.value.reason.code == 1008


async def test_the_sdk_worker_stops_with_a_clear_error_when_its_registration_is_refused(limited_node: Node) -> None:
    @ironflow.function(id="f", triggers=["e.go"])
    async def f(ctx: Any) -> None:
        return None

    for worker_class in (ironflow.StreamingWorker, ironflow.PullWorker):
        worker = worker_class(limited_node.url, [f], max_concurrent_jobs=50, handle_signals=False)
        with trio.fail_after(10), pytest.raises(ironflow.RegistrationRefusedError, match="max_slots_per_session"):
            await worker.run()


async def test_emits_match_functions_through_the_trigger_index(node: Node, http: httpx.AsyncClient) -> None:
    functions = [
        {"id": "exact", "triggers": [{"event": "a.b.c"}]},
        {"id": "top", "triggers": [{"event": "a.*"}]},
        {"id": "mid", "triggers": [{"event": "a.b.*"}, {"event": "a.*"}]},
        {"id": "other", "triggers": [{"event": "a.bc"}]},
    ]
    assert (await register_pull(http, functions)).status_code == 201
    runs = (await emit(http, "a.b.c"))["run_ids"]
    detail = [(await http.get(f"/v1/runs/{r}")).json()["run"]["function_id"] for r in runs]
    assert sorted(detail) == ["exact", "mid", "top"]  # mid matched twice, started once
    runs = (await emit(http, "a.b"))["run_ids"]
    detail = [(await http.get(f"/v1/runs/{r}")).json()["run"]["function_id"] for r in runs]
    assert sorted(detail) == ["mid", "top"]
    assert (await emit(http, "b.a.b.c"))["run_ids"] == []
    # A re-registration that drops a trigger drops it from the index too.
    assert (await register_pull(http, [{"id": "top", "triggers": [{"event": "z.go"}]}])).status_code == 201
    runs = (await emit(http, "a.b.c"))["run_ids"]
    assert len(runs) == 2


async def test_concurrent_emits_each_get_their_own_event_and_runs_and_keys_still_dedupe(
    node: Node, http: httpx.AsyncClient
) -> None:
    """Emits that arrive together are ingested together (one store call for
    those without a key): every request still gets its own answer."""
    assert (await register_pull(http, [{"id": "f", "triggers": [{"event": "c.go"}]}])).status_code == 201
    answers: dict[int, httpx.Response] = {}

    async def send(i: int) -> None:
        body: dict[str, Any] = {"name": "c.go" if i % 2 else "c.nobody", "data": {"i": i}}
        if i >= 60:
            body["idempotency_key"] = "same-key"
        answers[i] = await http.post("/v1/events", json=body)

    async with trio.open_nursery() as nursery:
        for i in range(64):
            nursery.start_soon(send, i)
    fresh = [i for i in range(60)]
    assert all(answers[i].status_code == 201 for i in fresh)
    assert len({answers[i].json()["event_id"] for i in fresh}) == 60
    for i in fresh:
        runs = answers[i].json()["run_ids"]
        assert len(runs) == (1 if i % 2 else 0)
        for run_id in runs:
            detail = (await http.get(f"/v1/runs/{run_id}")).json()
            assert detail["run"]["event_id"] == answers[i].json()["event_id"]
    keyed = sorted(answers[i].status_code for i in range(60, 64))
    assert keyed == [200, 200, 200, 201]
    assert len({answers[i].json()["event_id"] for i in range(60, 64)}) == 1


# ── 6. framework errors stay 4xx ────────────────────────────────────────────


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "POST"])
async def test_plain_http_on_the_worker_websocket_path_is_426(
    node: Node, http: httpx.AsyncClient, method: str
) -> None:
    resp = await http.request(method, "/v1/worker")
    assert resp.status_code in (405, 426) if method == "POST" else resp.status_code == 426
    if method in ("GET", "OPTIONS"):
        assert resp.json()["code"] == "UPGRADE_REQUIRED"


async def test_a_websocket_upgrade_on_another_path_is_refused_with_a_4xx(node: Node, http: httpx.AsyncClient) -> None:
    for path in ("/v1/nope", "/v1/events", "/healthz"):
        url = node.url.replace("http://", "ws://") + path
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with trio_websocket.open_websocket_url(url):
                pass
        assert 400 <= rejected.value.status_code < 500
    assert (await http.get("/healthz")).status_code == 200


def test_the_node_keeps_an_idle_connection_longer_than_client_pools_do() -> None:
    # A request sent on a connection the node closes at that moment gets no
    # answer (httpx: "Server disconnected without sending a response"). The
    # SDK's pool (httpx) drops its idle connections itself first.
    assert Timings().http_keep_alive_s > httpx.Limits().keepalive_expiry + 1


async def test_an_idle_connection_is_kept_for_the_keep_alive_then_closed(
    database_url: str, tmp_path: Any, nursery: trio.Nursery
) -> None:
    from ironflow.config import load_config

    config = load_config(
        env={}, dev=True, overrides={"db": database_url, "port": 0, "state_dir": str(tmp_path / "ka")},
        timing_overrides={"http_keep_alive_s": 0.5},
    )
    node: Node = await nursery.start(Node(config).run)

    def local_port(resp: httpx.Response) -> int:
        return int(resp.extensions["network_stream"].get_extra_info("client_addr")[1])

    # The client's own pool never drops a connection: what closes one is the node.
    limits = httpx.Limits(keepalive_expiry=None)
    async with httpx.AsyncClient(base_url=node.url, limits=limits) as http:
        first = local_port(await http.get("/healthz"))
        await trio.sleep(0.2)
        assert local_port(await http.get("/healthz")) == first  # idle 0.2 s: kept
        await trio.sleep(1.0)
        assert local_port(await http.get("/healthz")) != first  # idle 1 s: the node closed it
    node.stop()


async def test_an_internal_fault_is_a_500_with_a_request_id_also_in_the_log(
    node: Node, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(node.store, "runs_page", broken)
    with caplog.at_level(logging.ERROR, logger="ironflow.api"):
        resp = await http.get("/v1/runs")
    assert resp.status_code == 500 and resp.json()["code"] == "INTERNAL"
    request_id = resp.json()["message"].split("request id ")[1].rstrip(")")
    assert request_id.startswith("req_")
    assert any(getattr(r, "fields", {}).get("request_id") == request_id for r in caplog.records)


async def test_functions_no_worker_served_lately_are_listed_as_not_live_and_deleted_ones_only_with_all(
    node: Node, http: httpx.AsyncClient
) -> None:
    assert (await register_pull(http, fns("old"))).status_code == 201
    # Its pull session expires, then the liveness window after it passes.
    await skewed(node.store).advance_clock(
        node.config.timings.session_expiry_s + node.config.limits.function_live_s + 1
    )
    assert (await register_pull(http, fns("fresh", event="f.go"))).status_code == 201
    listed = {f["id"]: f["live"] for f in (await http.get("/v1/functions")).json()["functions"]}
    assert listed == {"old": False, "fresh": True}
    assert (await http.delete("/v1/functions/old")).status_code == 200
    assert [f["id"] for f in (await http.get("/v1/functions")).json()["functions"]] == ["fresh"]
    everything = {f["id"]: f["deleted_at"] is not None
                  for f in (await http.get("/v1/functions", params={"all": "true"})).json()["functions"]}
    assert everything == {"old": True, "fresh": False}
