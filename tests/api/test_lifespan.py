"""The node answers the ASGI lifespan protocol itself (ironflow/api/hot.py)."""

from __future__ import annotations

from typing import Any

from ironflow.api.hot import _serve_lifespan
from tests.api.test_openapi import _app


async def test_lifespan_startup_and_shutdown_complete() -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> Any:
        return incoming.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    await _serve_lifespan(receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_the_quart_app_has_no_serving_hooks_that_the_node_would_skip() -> None:
    app = _app()
    assert app.before_serving_funcs == [] and app.after_serving_funcs == []
    assert app.while_serving_gens == []
