"""The client's answer to an outage of the engine's database: send the emit again.

A node whose database is unavailable answers 503 ``STORE_UNAVAILABLE`` (507
``STORAGE_FULL``) with a ``Retry-After``: the emit did not happen, and the
same emit sent again later happens once (with an idempotency key, or without
one: nothing of it was stored). 503 ``COMMIT_OUTCOME_UNKNOWN`` may have
happened: sent again only with an idempotency key, which the engine
deduplicates. Bounded: :data:`EMIT_ATTEMPTS` tries in all, backing off from
the ``Retry-After`` to :data:`BACKOFF_MAX_S`, with jitter, each retry logged.
"""

from __future__ import annotations

import logging
import random

import httpx
import msgspec

from ironflow.protocol import ApiError

_log = logging.getLogger("ironflow.client")

# Tries of one emit in all (the first and its retries): with the backoff
# below, about half a minute of outage is waited out before the caller hears it.
EMIT_ATTEMPTS = 6
# The longest wait between two tries, whatever the Retry-After and attempts.
BACKOFF_MAX_S = 8.0
# Used when an outage answer carries no (readable) Retry-After.
DEFAULT_RETRY_AFTER_S = 1.0
# Retries of tries that came at once would come at once again: spread them.
JITTER = 0.25
# The engine did not store the emit: safe to send again with or without a key.
NOT_DONE = frozenset({"STORE_UNAVAILABLE", "STORAGE_FULL"})
# The engine may have stored it: safe to send again only with an idempotency key.
MAYBE_DONE = frozenset({"COMMIT_OUTCOME_UNKNOWN"})


def retry_delay(resp: httpx.Response, attempt: int, *, keyed: bool) -> float | None:
    """Seconds to wait before try ``attempt + 1`` of an emit answered ``resp``,
    or None when it must not be sent again (not an outage, or out of tries)."""
    if resp.status_code not in (503, 507) or attempt >= EMIT_ATTEMPTS:
        return None
    try:
        code = msgspec.json.decode(resp.content, type=ApiError).code
    except msgspec.DecodeError:
        return None  # not the engine's answer (a proxy's page): not ours to judge
    if code not in NOT_DONE and not (keyed and code in MAYBE_DONE):
        return None
    try:
        after = float(resp.headers.get("retry-after", DEFAULT_RETRY_AFTER_S))
    except ValueError:
        after = DEFAULT_RETRY_AFTER_S
    delay = min(max(after, 2.0 ** (attempt - 1)), BACKOFF_MAX_S)
    return delay * random.uniform(1.0, 1.0 + JITTER)


def log_retry(name: str, resp: httpx.Response, attempt: int, delay: float) -> None:
    """One warning line per retry: what the engine said, and when it is sent again."""
    try:
        error = msgspec.json.decode(resp.content, type=ApiError)
        said = f"{error.code}: {error.message}"
    except msgspec.DecodeError:
        said = resp.reason_phrase
    _log.warning(
        "Engine unavailable (%d %s); sending emit %r again in %.1f s (try %d of %d)",
        resp.status_code, said, name, delay, attempt + 1, EMIT_ATTEMPTS,
    )
