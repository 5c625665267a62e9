"""The dashboard: ``GET /`` (one HTML page) and its assets under ``/dashboard/``.

No build step and no network: plain HTML, one vanilla JS file and one CSS
file shipped as package data in ``ironflow/dashboard/``. The page reads the
same ``/v1`` API as the CLI with the caller's key (kept in the browser's
sessionStorage), and renders every value as text, never as markup; the
Content-Security-Policy below refuses inline scripts as a second guard.
"""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint, Response, send_from_directory

# The page's assets, shipped inside the package (pyproject's package-data).
ASSETS = Path(__file__).resolve().parent.parent / "dashboard"
# Scripts, styles and requests only from this node; no inline script, no frames.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)

bp = Blueprint("dashboard", __name__, static_folder=str(ASSETS), static_url_path="/dashboard")


@bp.get("/")
async def index() -> Response:
    response: Response = await send_from_directory(ASSETS, "index.html")
    response.headers["Content-Security-Policy"] = CSP
    return response


@bp.after_request
async def revalidate(response: Response) -> Response:
    # Revalidate (cheap: ETag) rather than cache for hours, so a node upgraded
    # in place never serves a page with the previous version's script.
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response
