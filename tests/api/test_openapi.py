"""The OpenAPI document: valid OpenAPI 3.1, and a description of exactly the
routes the app serves, with schemas generated from the protocol types."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import trio
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate

from ironflow.api import ApiDeps, create_app
from ironflow.api.openapi import ROUTES, build_document
from ironflow.config import NodeConfig
from ironflow.protocol import EmitRequest, ErrorInfo, RunDetail, RunRecord, StepRecord

# HEAD and OPTIONS are answered by the framework for every GET route.
_IMPLICIT_METHODS = {"HEAD", "OPTIONS"}


class _NoStore:
    """Routing and the document need no store; the app only subscribes to run ends."""

    def on_runs_ended(self, listener: Any) -> None:
        pass

    def on_run_results(self, listener: Any) -> None:
        pass


def _app() -> Any:
    deps = ApiDeps(
        store=_NoStore(),  # type: ignore[arg-type]
        config=NodeConfig(dev=True),
        node_id="node_test",
        directory=None,  # type: ignore[arg-type]
        kicks=None,  # type: ignore[arg-type]
        shutdown_requested=trio.Event(),
        ready=trio.Event(),
    )
    return create_app(deps)


def _served_routes(app: Any) -> set[tuple[str, str]]:
    """(method, OpenAPI-style path) of every rule the app serves."""
    served = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in (rule.methods or set()) - _IMPLICIT_METHODS:
            served.add((method.lower(), path))
    return served


def test_the_document_is_valid_openapi_3_1() -> None:
    document = build_document()
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises OpenAPIValidationError on any fault
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), "operation ids must be unique"


def test_the_document_describes_every_route_the_app_serves_and_no_other() -> None:
    served = _served_routes(_app())
    described = {(r.method, r.path) for r in ROUTES}
    assert served - described == set(), "served but not described"
    assert described - served == set(), "described but not served"
    document_paths = {
        (method, path) for path, ops in build_document()["paths"].items() for method in ops
    }
    assert document_paths == described


async def test_get_openapi_json_serves_the_generated_document() -> None:
    client = _app().test_client()
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    assert response.content_type == "application/json"
    assert msgspec.json.decode(await response.get_data()) == msgspec.json.decode(
        msgspec.json.encode(build_document())
    )


def _schema_validator(document: dict[str, Any], schema: dict[str, Any]) -> OAS31Validator:
    return OAS31Validator({**schema, "components": document["components"]})


def test_a_real_run_detail_matches_the_documented_answer_of_get_run() -> None:
    document = build_document()
    op = document["paths"]["/v1/runs/{run_id}"]["get"]
    schema = op["responses"]["200"]["content"]["application/json"]["schema"]
    run = RunRecord(
        "run_1", "fn", "evt_1", None, "failed", 2, 3, 1, 2, None,
        ErrorInfo("ValueError", "boom", "Traceback ..."), 1.0, 1.5, 2.0,
    )
    step = StepRecord("run_1", "s1", "fetch", "run", "completed", {"x": 1}, None, 3.5, 1, 1.2)
    detail = RunDetail(run, [step], None, None, None, 2.5)
    instance = msgspec.json.decode(msgspec.json.encode(detail))
    _schema_validator(document, schema).validate(instance)
    instance["run"]["status"] = "exploded"  # not a RunStatus
    assert not _schema_validator(document, schema).is_valid(instance)


def test_the_emit_body_schema_carries_the_protocol_bounds() -> None:
    document = build_document()
    op = document["paths"]["/v1/events"]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    validator = _schema_validator(document, schema)
    assert validator.is_valid(msgspec.to_builtins(EmitRequest("order/created", {"id": 1})))
    assert not validator.is_valid({"name": ""})  # a Name is 1..256 characters
    assert not validator.is_valid({"name": "a", "surprise": 1})  # unknown fields are refused


def test_the_document_declares_its_own_answer_a_json_object() -> None:
    # Found by Schemathesis (tests/integration/test_fuzz_openapi.py): GET
    # /openapi.json was declared to answer a JSON string.
    answer = build_document()["paths"]["/openapi.json"]["get"]["responses"]["200"]
    assert answer["content"]["application/json"]["schema"] == {"type": "object"}
    metrics = build_document()["paths"]["/metrics"]["get"]["responses"]["200"]
    assert metrics["content"]["text/plain"]["schema"] == {"type": "string"}
