"""The paging parameters every list route reads: ``limit``, ``cursor``, ``include``.

``limit`` is rows per page, at most the node's ``limits.max_page_rows``: a
larger one is refused (422 ``LIMIT_EXCEEDED``, naming the limit) rather than
clamped, so a client that reads one page never mistakes it for all there
is. ``cursor`` is the previous page's ``next_cursor``, passed back as it
came (a malformed one is 422 ``INVALID_CURSOR``, from the store).
``include=data`` keeps the payloads a list otherwise leaves out. Every page
is also capped at ``limits.max_page_bytes`` (ironflow/store/pages.py).
"""

from __future__ import annotations

from quart import request

from ironflow.api.errors import fail
from ironflow.api.state import state
from ironflow.store import PageRequest

# What ``include`` may name: the payloads a list leaves out by default.
INCLUDE_VALUES = frozenset({"data"})


def page_request(default_limit: int) -> PageRequest:
    """The page the request asks for (``default_limit`` rows if it names none,
    fewer on a node whose row cap is lower)."""
    limits = state().config.limits
    raw = request.args.get("limit")
    limit = min(default_limit, limits.max_page_rows)
    if raw is not None:
        try:
            limit = int(raw)
        except ValueError:
            fail(400, "VALIDATION_ERROR", f"query parameter limit must be an integer, got {raw!r}")
        if limit < 1:
            fail(400, "VALIDATION_ERROR", f"query parameter limit must be at least 1, got {limit}")
    if limit > limits.max_page_rows:
        fail(
            422,
            "LIMIT_EXCEEDED",
            f"limit {limit} is past this node's limits.max_page_rows ({limits.max_page_rows}):"
            " read the rest page by page with ?cursor=<next_cursor>",
        )
    include = {part.strip() for part in request.args.get("include", "").split(",") if part.strip()}
    unknown = include - INCLUDE_VALUES
    if unknown:
        fail(
            400,
            "VALIDATION_ERROR",
            f"query parameter include may name {', '.join(sorted(INCLUDE_VALUES))};"
            f" got {', '.join(sorted(unknown))}",
        )
    return PageRequest(
        limit=limit,
        cursor=request.args.get("cursor") or None,
        include_data="data" in include,
        max_bytes=limits.max_page_bytes,
    )
