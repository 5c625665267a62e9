"""The node's HTTP and websocket surface (quart-trio under hypercorn).

One module per surface, each handler a named function of a few lines
(decode → one store call → kick → encode):

- ``health``: ``/healthz``, ``/readyz``, ``/metrics``;
- ``events``, ``runs``, ``functions``, ``audit``, ``keys``: the ``/v1`` REST API;
- ``event_reads``: stored events and a run's re-run (read by the dashboard);
- ``stats``: recent runs counted by status (the dashboard's chart and rates);
- ``dashboard``: the page at ``/`` and its assets;
- ``openapi``: ``/openapi.json``, generated from the protocol types;
- ``capacity``: leases, sessions and the queue (platform keys only);
- ``pull``: the pull-worker long-poll endpoints;
- ``worker_socket``: the streaming-worker websocket ``/v1/worker``;
- ``auth`` (who is calling), ``errors`` (bodies in, error answers out),
  ``state`` (the node's dependencies), ``app`` (assembly);
- ``hot``: ``POST /v1/events`` served on ASGI ahead of the framework (why: there);
- ``connections``: the caps on open connections and held result waits, the
  request-head timeout's carrier.

The bodies and records are the typed contract in ``ironflow.protocol.http``;
see ``docs/http-api.md``.
"""

from __future__ import annotations

from ironflow.api.app import create_app
from ironflow.api.hot import HotRoutes
from ironflow.api.state import ApiDeps

__all__ = ["ApiDeps", "HotRoutes", "create_app"]
