"""Schemathesis against the node's own OpenAPI document: every route, bodies,
path and query parameters generated from the schemas the node publishes
(``GET /openapi.json``), sent to a real node process.

Whatever comes, the node never answers a 5xx, and every answer is one the
document declares (status, media type, schema); after every route had its
examples, no actor was restarted and the honest worker still completes a run.
Platform routes are reached with a platform key, the pull-session routes with
the module's real session (and its secret); half the run ids are real ones.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import schemathesis
import trio
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from ironflow.api.openapi import build_document
from ironflow.protocol import SESSION_SECRET_HEADER
from ironflow.store import open_store
from tests.integration.fuzz_target import Target, assert_node_unharmed, fuzz_settings

pytestmark = pytest.mark.slow

# Beyond "no 5xx": every answer is one the document declares, with the declared
# media type and schema (the document tells the truth), and a method a route does
# not serve gets a 405 naming the ones it does. Left out: the checks that expect
# a 401 without a key, since this node runs --dev (org routes need none).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, unsupported_method]
# Examples per route: every operation is reached, each a few dozen ways, and
# the whole module stays within ~20 s.
EXAMPLES_PER_ROUTE = 8

schema = schemathesis.openapi.from_dict(build_document())


@pytest.fixture(scope="module")
def platform_key(fuzz_target: Target) -> str:
    async def mint() -> str:
        store = open_store(str(fuzz_target.db))
        await store.open()
        try:
            return str((await store.create_api_key("platform", "platform_admin"))[1])
        finally:
            await store.close()

    return trio.run(mint)


@pytest.fixture(scope="module")
def real_run_id(fuzz_target: Target) -> Iterator[str]:
    yield fuzz_target.http.post("/v1/events", json={"name": "crash.go"}).json()["run_ids"][0]


@schema.parametrize()
@fuzz_settings(EXAMPLES_PER_ROUTE)
def test_no_route_answers_a_5xx(case: schemathesis.Case, fuzz_target: Target, platform_key: str,
                                real_run_id: str) -> None:
    params = case.path_parameters or {}
    if "session_id" in params:
        params["session_id"] = fuzz_target.session_id
    if "run_id" in params and zlib.crc32(str(params["run_id"]).encode()) % 2:
        params["run_id"] = real_run_id
    headers = {"Authorization": f"Bearer {platform_key}", SESSION_SECRET_HEADER: fuzz_target.secret}
    response = case.call(base_url=fuzz_target.url, headers=headers, timeout=30)
    case.validate_response(response, checks=CHECKS)


def test_the_node_is_unharmed_after_every_route_was_fuzzed(fuzz_target: Target) -> None:
    # Runs after the parametrized test above (file order): a fresh node, so no restart at all.
    assert_node_unharmed(fuzz_target, 0.0)
