"""Who is calling: an org key (``ifkey_…``), a platform key (``ifplatform_…``),
or nobody (allowed on org endpoints of a ``--dev`` node only)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from quart import request

from ironflow.api.errors import fail
from ironflow.api.state import ApiState, state
from ironflow.store import Principal

# How long a verified API key is trusted without asking the database again.
AUTH_CACHE_S = 30.0
# Roles of a platform key that may mint further platform keys.
PLATFORM_ADMIN_ROLES = frozenset({"admin", "platform_admin"})


async def principal(headers: Any = None, st: ApiState | None = None) -> Principal | None:
    """The caller's principal from ``Authorization: Bearer <key>``; None without one.

    ``headers`` and ``st`` default to the current request's and app's (the
    framework-free hot path passes its own). A malformed header or an unknown
    key is a 401.
    """
    st = st or state()
    header = (headers if headers is not None else request.headers).get("Authorization", "")
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        fail(401, "UNAUTHORIZED", "Authorization header must be 'Bearer <key>'")
    cache = st.auth_cache
    digest = hashlib.sha256(key.encode()).hexdigest()
    cached = cache.get(digest)
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    found = await st.store.authenticate(key)
    if found is None:
        fail(401, "UNAUTHORIZED", "invalid API key")
    cache[digest] = (time.monotonic() + AUTH_CACHE_S, found)
    return found


async def require_org(headers: Any = None, st: ApiState | None = None) -> Principal | None:
    """Any valid key; none at all only on a ``--dev`` node."""
    st = st or state()
    found = await principal(headers, st)
    if found is None and not st.config.dev:
        fail(401, "UNAUTHORIZED", "an API key is required (Authorization: Bearer ifkey_…)")
    return found


async def require_platform() -> Principal:
    """A platform key, in dev as in production; anything else is a 403."""
    found = await principal()
    if found is None or found.kind != "platform":
        fail(403, "FORBIDDEN", "platform credentials required here")
    return found
