"""How a command talks to a node: the SDK's sync client, failures made readable.

Every command but ``serve`` sends one call from :mod:`ironflow.sdk.calls`
through :class:`~ironflow.sdk.client.IronflowSync` and either prints the
API's JSON (``--json``) or renders the decoded record. Whatever goes wrong
becomes a :class:`~ironflow.cli.errors.CliFailure` (exit code 1) whose hints
say what to do next.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click
import httpx
import msgspec

from ironflow.cli import render
from ironflow.cli.errors import CliFailure
from ironflow.config import BOOTSTRAP_KEY_FILE, DEFAULT_SERVER_URL, DEFAULT_STATE_DIR
from ironflow.sdk.calls import Answer, Call
from ironflow.sdk.client import IronflowSync
from ironflow.sdk.errors import IronflowAPIError

T = TypeVar("T")

PLATFORM_HINT = (
    "this needs a platform key (ifplatform_…); with database access mint the first "
    "one with: ironflow keys create --platform --db .ironflow/ironflow.db"
)


def open_client(ctx: click.Context, server: str | None, api_key: str | None) -> IronflowSync:
    """The client for a command: its own -s/--api-key win over the group's.

    The group stores its options (and, in tests, an httpx ``transport``) in
    ``ctx.obj``; the client is closed when the command's context closes.
    """
    obj = ctx.ensure_object(dict)
    client = IronflowSync(
        server or obj.get("server") or DEFAULT_SERVER_URL,
        api_key or obj.get("api_key"),
        transport=obj.get("transport"),
    )
    ctx.call_on_close(client.close)
    return client


def api_failure(error: IronflowAPIError) -> CliFailure:
    """``CODE: message (HTTP status)``, with a hint for 401 and a platform 403."""
    hints: list[str] = []
    if error.status == 401:
        hints.append("pass an API key with --api-key or IRONFLOW_API_KEY")
        state_dir = os.environ.get("IRONFLOW_STATE_DIR") or DEFAULT_STATE_DIR
        key_path = Path(state_dir) / BOOTSTRAP_KEY_FILE
        if key_path.exists():
            hints.append(
                f"a --dev node wrote an org admin key to {key_path} "
                '(its "key" field); it is not used automatically'
            )
    elif error.status == 403 and "platform" in error.message:
        hints.append(PLATFORM_HINT)
    return CliFailure(f"{error.code}: {error.message} (HTTP {error.status})", hints=hints)


def send(client: IronflowSync, call: Call[T]) -> Answer[T]:
    """Send ``call``; any failure (refused, unreachable, undecodable) is a CliFailure."""
    server = client.server_url
    try:
        return client.request(call)
    except IronflowAPIError as exc:
        raise api_failure(exc) from None
    except httpx.ConnectError:
        raise CliFailure(
            f'cannot reach the engine at {server} (is "ironflow serve --dev" running?)'
        ) from None
    except httpx.TimeoutException as exc:
        raise CliFailure(f"the engine at {server} did not answer in time ({exc})") from None
    except httpx.HTTPError as exc:
        raise CliFailure(f"request to {server} failed: {exc}") from None
    except msgspec.DecodeError as exc:
        raise CliFailure(
            f"the engine at {server} answered {call.method} {call.path} "
            f"with something other than a {call.answer.__name__} ({exc})"
        ) from None


def show(
    client: IronflowSync, call: Call[T], *, as_json: bool, render_answer: Callable[[T], None]
) -> None:
    """Send ``call`` and print the API's JSON (``as_json``) or ``render_answer(decoded)``."""
    answer = send(client, call)
    if as_json:
        render.echo_json(answer.content)
    else:
        render_answer(answer.value)
