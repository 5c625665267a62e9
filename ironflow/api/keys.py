"""``POST /v1/keys``: mint API keys (who may mint which kind is decided here)."""

from __future__ import annotations

from typing import Literal

from quart import Blueprint, Response

from ironflow.api.auth import PLATFORM_ADMIN_ROLES, principal
from ironflow.api.errors import fail, json_response, optional_body
from ironflow.api.state import state
from ironflow.protocol import KeyCreateRequest, KeyCreateResponse
from ironflow.store import Principal

bp = Blueprint("keys", __name__)


def _check_may_create(caller: Principal | None, platform: bool) -> None:
    """A platform key needs a platform admin; an org key an admin key (or a --dev node)."""
    if platform:
        if caller is None or caller.kind != "platform":
            fail(403, "FORBIDDEN", "platform credentials required here")
        if caller.role not in PLATFORM_ADMIN_ROLES:
            fail(403, "FORBIDDEN", "only a platform admin can create platform keys")
    elif caller is None:
        if not state().config.dev:
            fail(401, "UNAUTHORIZED", "an admin API key is required to create keys")
    elif caller.kind == "org" and caller.role != "admin":
        fail(403, "FORBIDDEN", "only an admin key can create keys")


@bp.post("/v1/keys")
async def create_key() -> Response:
    body = await optional_body(KeyCreateRequest)
    _check_may_create(await principal(), body.platform)
    kind: Literal["org", "platform"] = "platform" if body.platform else "org"
    key_id, key = await state().store.create_api_key(kind, body.role)
    return json_response(KeyCreateResponse(key_id, key, kind, body.role), 201)
