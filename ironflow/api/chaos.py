"""Fault injection for chaos tests: crash a supervised actor on request.

Served only by a node started with ``--chaos`` (``NodeConfig.chaos``), and
only to platform keys. On any other node both routes answer exactly what an
unknown route answers (404 ``NOT_FOUND``), so a production node neither
serves nor reveals them. ``scripts/chaos.py`` drives them.
"""

from __future__ import annotations

from typing import Protocol

from quart import Blueprint, Response, request

from ironflow.api.auth import require_platform
from ironflow.api.errors import decode, fail, json_response
from ironflow.api.state import state
from ironflow.protocol import ActorList, ActorRecord, ChaosCrashRequest

bp = Blueprint("chaos", __name__)


class CrashableActors(Protocol):
    """What the routes need of the node's supervisor (``actors.supervisor.Supervisor``)."""

    @property
    def names(self) -> list[str]: ...

    def restarts(self, name: str) -> int: ...

    def crash(self, name: str) -> bool: ...


async def _chaos_actors() -> CrashableActors:
    """The supervisor, for a platform key on a ``--chaos`` node; else the unknown-route 404."""
    actors = state().deps.actors
    if not state().config.chaos or actors is None:
        fail(404, "NOT_FOUND", f"no route for {request.method} {request.path}")
    await require_platform()
    return actors


def _listing(actors: CrashableActors) -> ActorList:
    return ActorList([ActorRecord(name, actors.restarts(name)) for name in actors.names])


@bp.get("/v1/chaos/actors")
async def list_actors() -> Response:
    return json_response(_listing(await _chaos_actors()))


@bp.post("/v1/chaos/crash")
async def crash_actor() -> Response:
    """Crash one actor now; 202 with every actor's restart count before the crash.

    404 ``ACTOR_NOT_FOUND`` for a name the supervisor does not own; 409
    ``ACTOR_RESTARTING`` while that actor waits out its restart backoff
    (nothing runs to crash, and nothing is remembered for later).
    """
    actors = await _chaos_actors()
    body = decode(await request.get_data(), ChaosCrashRequest)
    if body.actor not in actors.names:
        fail(404, "ACTOR_NOT_FOUND", f"no actor {body.actor!r}; actors: {', '.join(actors.names)}")
    before = _listing(actors)
    if not actors.crash(body.actor):
        fail(409, "ACTOR_RESTARTING", f"actor {body.actor!r} is waiting out its restart backoff")
    return json_response(before, 202)
