"""The dashboard is served by the node from package data, with a policy that
refuses inline script, and its script never turns data into markup."""

from __future__ import annotations

import re

from ironflow.api.dashboard import ASSETS
from tests.api.test_openapi import _app

# The DOM sinks that parse a string as HTML: the script must use none of them.
HTML_SINKS = re.compile(r"\.(innerHTML|outerHTML|insertAdjacentHTML)\b|document\.write|\beval\(|new Function\(")


async def test_the_page_is_served_at_the_root_with_a_policy_refusing_inline_script() -> None:
    client = _app().test_client()
    response = await client.get("/")
    assert response.status_code == 200
    assert response.content_type.startswith("text/html")
    body = (await response.get_data()).decode()
    assert '<script src="/dashboard/app.js"' in body and "<script>" not in body
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert response.headers["Cache-Control"] == "no-cache"


async def test_the_script_and_style_sheet_are_served_from_the_package() -> None:
    client = _app().test_client()
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        response = await client.get(f"/dashboard/{name}")
        assert response.status_code == 200, name
        assert kind in response.content_type
        assert await response.get_data() == (ASSETS / name).read_bytes()
    missing = await client.get("/dashboard/../api/dashboard.py")
    assert missing.status_code == 404


def test_the_script_never_parses_strings_as_html() -> None:
    script = (ASSETS / "app.js").read_text()
    assert HTML_SINKS.findall(script) == []
    assert "textContent" in script  # how every value reaches the page
