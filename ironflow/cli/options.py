"""Options every client command shares, and the decorator that adds them.

``-s/--server`` and ``--api-key`` are accepted before the command name (on
the group, where they also read ``IRONFLOW_*``) and after it (on the command,
where they win).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from ironflow.cli.client import open_client
from ironflow.config import DEFAULT_SERVER_URL


def server_option(envvar: bool) -> Callable[[Any], Any]:
    return click.option(
        "-s",
        "--server",
        envvar="IRONFLOW_SERVER_URL" if envvar else None,
        default=DEFAULT_SERVER_URL if envvar else None,
        show_default=envvar,
        help="Engine URL (env IRONFLOW_SERVER_URL).",
    )


def api_key_option(envvar: bool) -> Callable[[Any], Any]:
    return click.option(
        "--api-key",
        envvar="IRONFLOW_API_KEY" if envvar else None,
        default=None,
        help="API key: ifkey_… (org) or ifplatform_… (platform) (env IRONFLOW_API_KEY).",
    )


def json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")(func)


def client_command(group: click.Group | None, name: str, **kwargs: Any) -> Callable[[Any], Any]:
    """A command of ``group`` (or a standalone one) accepting -s/--server and --api-key.

    The decorated function receives the command's client
    (:func:`~ironflow.cli.client.open_client`) as its first argument in place
    of those two options.
    """

    def decorate(func: Callable[..., Any]) -> click.Command:
        @functools.wraps(func)  # also carries the command's own click options over
        def with_client(server: str | None, api_key: str | None, **params: Any) -> Any:
            client = open_client(click.get_current_context(), server, api_key)
            return func(client, **params)

        with_options = server_option(envvar=False)(api_key_option(envvar=False)(with_client))
        make = click.command if group is None else group.command
        return make(name, **kwargs)(with_options)

    return decorate
