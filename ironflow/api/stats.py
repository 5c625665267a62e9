"""``GET /v1/stats/runs``: recent runs counted by status, per time bucket and
per function (the dashboard's runs-per-minute chart and failure rates)."""

from __future__ import annotations

from quart import Blueprint, Response

from ironflow.api.auth import require_org
from ironflow.api.errors import fail, json_response, query_int
from ironflow.api.state import state

bp = Blueprint("stats", __name__)

# At most a day back, and at most this many buckets: one answer stays small.
MAX_WINDOW_S = 86400
MAX_BUCKETS = 1440


@bp.get("/v1/stats/runs")
async def run_stats() -> Response:
    await require_org()
    window_s = query_int("window_s", 3600, low=60, high=MAX_WINDOW_S)
    bucket_s = query_int("bucket_s", 60, low=10, high=MAX_WINDOW_S)
    if window_s // bucket_s > MAX_BUCKETS:
        fail(400, "VALIDATION_ERROR", f"window_s / bucket_s must be at most {MAX_BUCKETS} buckets")
    return json_response(await state().store.run_stats(window_s=window_s, bucket_s=bucket_s))
