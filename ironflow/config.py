"""Node configuration: one typed object, built once at start-up and passed down.

Precedence, lowest first: built-in defaults (the seed's numbers) → the
``--dev`` profile → a YAML file (``-f``) → ``IRONFLOW_*`` environment
variables → command-line flags. The result is validated before anything
starts; a bad value is a clear :class:`ConfigError`, never a silent clamp.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import yaml

from ironflow.protocol import MAX_FUNCTIONS_HARD, MAX_SLOTS_HARD

# Default port of the original product, so its CLI habits carry over.
DEFAULT_PORT = 9123
# A lease or claim threshold closer than this multiple of the heartbeat interval
# would reclaim work from workers that are alive and merely slow.
MIN_HEARTBEAT_MULTIPLE = 2.0


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsafe."""


class Timings(msgspec.Struct, forbid_unknown_fields=True):
    """Every recovery and liveness timing, in seconds (seed defaults)."""

    heartbeat_interval_s: float = 30.0
    # A worker session expires when no heartbeat arrived for this long.
    session_expiry_s: float = 90.0
    scanner_interval_s: float = 30.0
    reservation_expiry_s: float = 30.0
    lease_expiry_s: float = 90.0
    recovery_grace_s: float = 30.0
    recovery_ceiling: int = 10
    stale_claim_interval_s: float = 60.0
    stale_claim_threshold_s: float = 120.0
    waker_interval_s: float = 1.0
    drain_timeout_s: float = 25.0
    node_heartbeat_s: float = 10.0
    # The dispatcher is kicked when work appears (locally, or from another node
    # through PostgreSQL LISTEN/NOTIFY); this idle re-check is only the safety
    # net for a notification lost while the listener reconnects.
    dispatch_idle_poll_s: float = 10.0
    # Ceiling on how long a pull worker's poll is held open by the node.
    poll_max_wait_s: float = 30.0
    # An actor that crashes is restarted after this backoff, doubling to the cap.
    restart_backoff_s: float = 0.05
    restart_backoff_max_s: float = 5.0
    # Finished runs older than this are deleted with their steps and audit rows
    # (a week, as peers default to); 0 keeps history forever.
    history_retention_s: float = 7 * 24 * 3600.0
    # How often the janitor looks for history past retention: deletion is
    # cheap and batched, and a minute keeps the database within ~1 minute of
    # the retention without the janitor competing with live work.
    janitor_interval_s: float = 60.0


# Timings where 0 means "off" rather than "unsafe".
ZERO_MEANS_OFF = frozenset({"history_retention_s"})

# `--dev` shortens loop 1 as well as loop 2 (deliberately beyond the seed).
DEV_TIMINGS: dict[str, float] = {
    "heartbeat_interval_s": 2.0,
    "session_expiry_s": 6.0,
    "scanner_interval_s": 1.0,
    "reservation_expiry_s": 5.0,
    "lease_expiry_s": 6.0,
    "recovery_grace_s": 1.0,
    "stale_claim_interval_s": 5.0,
    "stale_claim_threshold_s": 45.0,
}


class Limits(msgspec.Struct, forbid_unknown_fields=True):
    """What one worker may ask of a node; past a limit the request is refused.

    Each bounds a cost every other user pays: credit rows scanned per dispatch
    (slots), definitions upserted per connect (functions), runs created per
    emit (functions sharing one trigger pattern).
    """

    # Concurrent jobs (credit rows) one worker session may offer.
    max_slots_per_session: int = 1000
    # Function definitions one Register may carry.
    max_functions_per_worker: int = 1000
    # Functions one trigger pattern may start: the fan-out of a single emit.
    max_functions_per_trigger: int = 100
    # A function no worker registered for this long is listed as not live.
    function_live_s: float = 24 * 3600.0


class NodeConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a node needs to start."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # SQLite path or file URL, or a postgresql:// URL. None → .ironflow/ironflow.db
    db: str | None = None
    node_id: str | None = None
    dev: bool = False
    state_dir: str = ".ironflow"
    max_frame_bytes: int = 4 * 1024 * 1024
    idempotency_window_s: float = 24 * 3600.0
    log_level: str = "INFO"
    timings: Timings = msgspec.field(default_factory=Timings)
    limits: Limits = msgspec.field(default_factory=Limits)

    @property
    def database_url(self) -> str:
        """The database to open: ``db`` or the SQLite default under ``state_dir``."""
        return self.db or str(Path(self.state_dir) / "ironflow.db")

    @property
    def is_postgres(self) -> bool:
        return self.database_url.startswith(("postgres://", "postgresql://"))


def redact_url(url: str) -> str:
    """``scheme://***@host/db`` — a database URL safe to print or log."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


_ENV_FIELDS = {
    "IRONFLOW_HOST": "host",
    "IRONFLOW_PORT": "port",
    "IRONFLOW_DATABASE_URL": "db",
    "IRONFLOW_NODE_ID": "node_id",
    "IRONFLOW_STATE_DIR": "state_dir",
    "IRONFLOW_LOG_LEVEL": "log_level",
}


def _env_overrides(
    env: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    top: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for var, field in _ENV_FIELDS.items():
        if var in env:
            top[field] = env[var]
    for section, struct in ((timings, Timings), (limits, Limits)):
        for field in struct.__struct_fields__:
            var = "IRONFLOW_" + field.upper()
            if var in env:
                section[field] = env[var]
    return top, timings, limits


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.pop(name, None) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"config '{name}' must be a mapping")
    return value


def load_config(
    *,
    file: str | Path | None = None,
    env: dict[str, str] | None = None,
    dev: bool = False,
    overrides: dict[str, Any] | None = None,
    timing_overrides: dict[str, Any] | None = None,
    limit_overrides: dict[str, Any] | None = None,
) -> NodeConfig:
    """Build and validate the node configuration.

    Args:
      file: optional YAML file; top-level keys are NodeConfig fields, timings
        go under ``timings:`` and limits under ``limits:``.
      env: environment to read ``IRONFLOW_*`` variables from (default: os.environ).
      dev: apply the ``--dev`` profile (short loop-1 and loop-2 timings).
      overrides / timing_overrides / limit_overrides: flag values (``None``
        values are ignored).

    Raises:
      ConfigError: the file is unreadable, a value has the wrong type, or a
        timing is unsafe.
    """
    merged: dict[str, Any] = {}
    timings: dict[str, Any] = dict(DEV_TIMINGS) if dev else {}
    limits: dict[str, Any] = {}
    if file is not None:
        try:
            raw = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {file} must hold a mapping")
        timings.update(_section(raw, "timings"))
        limits.update(_section(raw, "limits"))
        merged.update(raw)
    env_top, env_timings, env_limits = _env_overrides(dict(os.environ if env is None else env))
    merged.update(env_top)
    timings.update(env_timings)
    limits.update(env_limits)
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    timings.update({k: v for k, v in (timing_overrides or {}).items() if v is not None})
    limits.update({k: v for k, v in (limit_overrides or {}).items() if v is not None})
    if dev:
        merged["dev"] = True
    merged["timings"] = timings
    merged["limits"] = limits
    try:
        config = msgspec.convert(merged, NodeConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    validate(config)
    return config


def validate(config: NodeConfig) -> None:
    """Refuse unsafe or nonsensical values with a message naming the field."""
    t = config.timings
    for field in Timings.__struct_fields__:
        value = getattr(t, field)
        if field in ZERO_MEANS_OFF:
            if value < 0:
                raise ConfigError(f"timings.{field} must be 0 (off) or positive, got {value}")
        elif value <= 0:
            raise ConfigError(f"timings.{field} must be positive, got {value}")
    hb = t.heartbeat_interval_s
    for field in ("lease_expiry_s", "session_expiry_s", "stale_claim_threshold_s"):
        value = getattr(t, field)
        if value < MIN_HEARTBEAT_MULTIPLE * hb:
            raise ConfigError(
                f"timings.{field}={value:g}s must be at least {MIN_HEARTBEAT_MULTIPLE:g}× the "
                f"heartbeat interval ({hb:g}s): a live but slow worker would lose its work"
            )
    if t.reservation_expiry_s < hb / 2:
        raise ConfigError(
            f"timings.reservation_expiry_s={t.reservation_expiry_s:g}s is shorter than half "
            f"the heartbeat interval ({hb:g}s)"
        )
    if t.restart_backoff_max_s < t.restart_backoff_s:
        raise ConfigError("timings.restart_backoff_max_s must be ≥ restart_backoff_s")
    if not 0 < config.port < 65536 and config.port != 0:
        raise ConfigError(f"port must be 0..65535, got {config.port}")
    if config.max_frame_bytes < 1024:
        raise ConfigError("max_frame_bytes must be at least 1024")
    _validate_limits(config.limits)


# Ceilings of the configurable limits: the wire types' own hard bounds.
_LIMIT_CEILINGS = {
    "max_slots_per_session": MAX_SLOTS_HARD,
    "max_functions_per_worker": MAX_FUNCTIONS_HARD,
    "max_functions_per_trigger": MAX_FUNCTIONS_HARD,
}


def _validate_limits(limits: Limits) -> None:
    for field, ceiling in _LIMIT_CEILINGS.items():
        value = getattr(limits, field)
        if not 1 <= value <= ceiling:
            raise ConfigError(f"limits.{field} must be in 1..{ceiling}, got {value}")
    if limits.function_live_s <= 0:
        raise ConfigError(f"limits.function_live_s must be positive, got {limits.function_live_s}")
