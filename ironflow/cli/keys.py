"""``ironflow keys create``: mint an API key through a node or straight in its database.

The only CLI module that may reach the store, for ``--db`` (how the first
platform key is made), and it imports ``ironflow.store`` late so that no other
command loads database code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import msgspec

from ironflow.cli import render
from ironflow.cli.client import send
from ironflow.cli.errors import CliFailure, UsageFailure
from ironflow.cli.options import client_command, json_option
from ironflow.config import redact_url
from ironflow.protocol import KeyCreateResponse
from ironflow.sdk import calls
from ironflow.sdk.client import IronflowSync


@click.group("keys")
def group() -> None:
    """API keys."""


def _open_store(url: str) -> Any:
    from ironflow.store import open_store

    return open_store(url)


def mint_in_database(url: str, kind: str, role: str) -> KeyCreateResponse:
    """Create a key directly in the database at ``url`` (SQLite path or postgresql:// URL).

    A SQLite file that does not exist is a usage failure (the engine creates
    it on first start); any driver error is a CliFailure naming the database
    without its password. The store is closed either way.
    """
    from ironflow.cli.serve import require_server

    require_server("ironflow keys create --db")
    import trio

    is_sqlite_path = "://" not in url and not url.startswith("file:")
    if is_sqlite_path and not Path(url).exists():
        raise UsageFailure(f"no database at {url} (start the engine once, or pass the right --db)")

    async def mint() -> tuple[str, str]:
        store = _open_store(url)
        await store.open()
        try:
            key_id, key = await store.create_api_key(kind, role)
        finally:
            await store.close()
        return str(key_id), str(key)

    try:
        key_id, key = trio.run(mint)
    except Exception as exc:  # any driver error: report it, do not dump a traceback
        raise CliFailure(f"cannot create the key in {redact_url(url)}: {exc}") from None
    return KeyCreateResponse(id=key_id, key=key, kind=kind, role=role)


@client_command(group, "create")
@click.option(
    "--platform", is_flag=True, help="A platform key (ifplatform_…) instead of an org key."
)
@click.option("--role", default="admin", show_default=True, help="Role of the new key.")
@click.option(
    "--db",
    default=None,
    help="Mint straight in this database (SQLite path or postgresql:// URL) instead of "
    "asking the engine; how the first platform key is made.",
)
@json_option
def keys_create(
    client: IronflowSync, platform: bool, role: str, db: str | None, as_json: bool
) -> None:
    """Create an API key and print it once.

    Without --db the engine mints it (POST /v1/keys) for the caller's key: an
    org admin key can create org keys; only a platform key can create another
    platform key.
    """
    if db is not None:
        created = mint_in_database(db, "platform" if platform else "org", role)
        content = msgspec.json.encode(created)
    else:
        answer = send(client, calls.create_key(platform=platform, role=role))
        created, content = answer.value, answer.content
    if as_json:
        render.echo_json(content)
    else:
        click.echo(f"created {created.kind} key {created.id} (role {created.role}):", err=True)
        click.echo(created.key)
    click.echo("warning: the key is not shown again; store it now.", err=True)
