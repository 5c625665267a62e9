"""Assembly: one quart-trio app with every surface's routes and the error handlers."""

from __future__ import annotations

from quart_trio import QuartTrio

from ironflow.api import (
    audit,
    capacity,
    chaos,
    dashboard,
    errors,
    event_reads,
    events,
    flow,
    functions,
    health,
    keys,
    openapi,
    pull,
    runs,
    stats,
    worker_socket,
)
from ironflow.api.state import EXTENSION, ApiDeps, ApiState

# Every surface, one module each (see the package docstring).
SURFACES = (
    health, openapi, dashboard, events, event_reads, runs, stats, functions, audit, keys, capacity,
    pull, worker_socket, chaos, flow,
)


def create_app(deps: ApiDeps) -> QuartTrio:
    """Build the quart-trio application serving ``deps``."""
    # No framework static route: the dashboard blueprint serves its own assets.
    app = QuartTrio("ironflow", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = deps.config.max_frame_bytes
    app.extensions[EXTENSION] = ApiState(deps)
    for surface in SURFACES:
        app.register_blueprint(surface.bp)
    errors.install(app, deps.config.max_frame_bytes)
    return app
