"""API keys: minted (shown once, stored as SHA-256) and authenticated.
"""

from __future__ import annotations

import secrets
from typing import Literal

from ironflow.ids import new_id
from ironflow.store.base import StoreError
from ironflow.store.core import (
    SqlStoreBase,
    Tx,
    token_hash,
)
from ironflow.store.records import Principal


class KeyOps(SqlStoreBase):
    """API keys: minted (shown once, stored as SHA-256) and authenticated."""

    async def create_api_key(
        self, kind: Literal["org", "platform"], role: str = "admin", key: str | None = None
    ) -> tuple[str, str]:
        if kind not in ("org", "platform"):
            raise StoreError(f"unknown key kind {kind!r}")
        secret = key or ("ifkey_" if kind == "org" else "ifplatform_") + secrets.token_hex(16)
        key_id = new_id("key")

        def work(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO api_keys (id, kind, role, key_hash, created_at)"
                " VALUES (?, ?, ?, ?, ironflow_now())",
                (key_id, kind, role, token_hash(secret)),
            )

        await self._transact(work)
        return key_id, secret

    async def authenticate(self, key: str) -> Principal | None:
        def work(tx: Tx) -> Principal | None:
            row = tx.fetchone(
                "SELECT id, kind, role FROM api_keys WHERE key_hash = ?", (token_hash(key),)
            )
            return None if row is None else Principal(row[0], row[1], row[2])

        return await self._transact(work)
