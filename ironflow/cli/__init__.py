"""The ``ironflow`` command line: run a node, emit events, inspect runs.

``ironflow serve`` (:mod:`~ironflow.cli.serve`) builds a
:class:`~ironflow.config.NodeConfig` from flags, ``IRONFLOW_*`` variables and
an optional YAML file, then runs the node under ``trio.run``. Every other
command sends one call through the SDK's sync client
(:mod:`~ironflow.cli.client`): it prints aligned tables for people
(:mod:`~ironflow.cli.render`) and, with ``--json``, the API's own JSON for
scripts.

Exit codes (:mod:`~ironflow.cli.errors`): 0 success; 1 the engine refused the
request or could not be reached; 2 bad usage (unknown flag, malformed
``--data``, invalid config).
"""

from __future__ import annotations

from typing import Any

import click

from ironflow.cli import audit, capacity, debounce, emit, functions, keys, runs, serve
from ironflow.cli.options import api_key_option, server_option

# Shared with ``python -m ironflow.node`` (``ironflow/node.py``), so its help is this one's.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@server_option(envvar=True)
@api_key_option(envvar=True)
@click.version_option(package_name="ironflow-py", prog_name="ironflow")
@click.pass_context
def main(ctx: click.Context, server: str, api_key: str | None) -> None:
    """Ironflow in Python: a durable-execution engine.

    Start a local node with `ironflow serve --dev`, run a worker, then
    `ironflow emit NAME --data '{...}'` and `ironflow runs get RUN_ID`.
    """
    obj = ctx.ensure_object(dict)
    obj.setdefault("server", server)
    obj.setdefault("api_key", api_key)


main.add_command(serve.serve)
main.add_command(emit.emit)
for _module in (runs, functions, capacity, audit, keys, debounce):
    main.add_command(_module.group)

__all__ = ["CONTEXT_SETTINGS", "main"]
