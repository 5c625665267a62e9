"""Node configuration: one typed object, built once at start-up and passed down.

Precedence, lowest first: built-in defaults (the seed's numbers) → the
``--dev`` profile → a YAML file (``-f``) → ``IRONFLOW_*`` environment
variables → command-line flags. The result is validated before anything
starts; a bad value is a clear :class:`ConfigError`, never a silent clamp.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from ironflow.protocol import MAX_FRAME_BYTES, MAX_FUNCTIONS_HARD, MAX_SLOTS_HARD

# Default port of the original product, so its CLI habits carry over.
DEFAULT_PORT = 9123
# Where clients (CLI, SDK) look for a node when told nothing else.
DEFAULT_SERVER_URL = f"http://localhost:{DEFAULT_PORT}"
# Default state directory (the SQLite file and the dev bootstrap key live there).
DEFAULT_STATE_DIR = ".ironflow"
# File in the state directory where `serve --dev` writes its org admin key.
BOOTSTRAP_KEY_FILE = ".ironflow_bootstrap_key.json"
# A lease or claim threshold closer than this multiple of the heartbeat interval
# would reclaim work from workers that are alive and merely slow.
MIN_HEARTBEAT_MULTIPLE = 2.0
# Least limits.max_page_bytes: below it a page of runs without their outputs
# (~300 bytes each) would hold only a few dozen.
MIN_PAGE_BYTES = 64 * 1024


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
    # The waker claims and resumes a sleep this long before its wake time; the
    # worker is sent the job at once and holds it (slot taken, handler not
    # started) until the wake time, so a burst of sleeps due at one instant is
    # claimed, queued and delivered ahead of it, not after. The cost: each such
    # job holds a worker slot for up to this long. 0 = off (claim at the wake
    # time). Waits' and invokes' timeouts are never resolved early (an event
    # or the child may still come).
    waker_lookahead_s: float = 1.0
    drain_timeout_s: float = 25.0
    node_heartbeat_s: float = 10.0
    # The dispatcher is kicked when work appears (locally, or from another node
    # through PostgreSQL LISTEN/NOTIFY); this idle re-check is only the safety
    # net for a notification lost while the listener reconnects.
    dispatch_idle_poll_s: float = 10.0
    # Ceiling on how long a pull worker's poll is held open by the node.
    poll_max_wait_s: float = 30.0
    # A held-open result request re-reads its run this often: the safety net for
    # a run ended by another node (this node's own ends wake it at once).
    result_recheck_s: float = 0.5
    # The capacity gauges are sampled this often: well under a usual 15 s
    # scrape interval, and one short read every few seconds is nothing.
    metrics_sample_s: float = 5.0
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
    # The store monitor reads the database this often while it is up, and
    # tries a write this often while it is down: /readyz turns 503 within
    # about this of an outage and 200 within about this of the recovery
    # (both well under a second; one read each time is nothing).
    store_probe_s: float = 0.25
    # ── cron triggers (actors/scheduler.py, docs/schedules.md) ──
    # The scheduler's longest sleep: a schedule registered through another
    # node is seen within it, so a tick fires within about this of its time
    # while any node is up (the node's own registrations wake it at once).
    scheduler_recheck_s: float = 1.0
    # A due tick older than this was missed (no node was up to fire it), not
    # merely late: its schedule's catch-up policy decides whether it fires.
    # Under a 2 s schedule's period, so a return from an outage fires one tick.
    cron_missed_after_s: float = 1.5
    # ── the streaming session (actors/session.py) ──
    # A JobAck that arrives alone waits this long for the rest of its segment
    # (the step results and job result a short handler sends right after it):
    # found, the lease is activated in the completion's own transaction, one
    # commit for the segment instead of two. Nothing waits for an ack's commit
    # (the SDK starts the handler once the ack is on the wire; the reservation
    # holds the segment meanwhile). 0: every ack is applied as it comes.
    ack_hold_s: float = 0.005
    # How long the node keeps an idle HTTP connection open. Longer than the
    # idle expiry of common clients' pools (httpx 5 s, the SDK's; nginx and
    # load balancers 60 s), so a client never sends a request on a connection
    # the node is closing at that moment: that request would get no answer
    # ("server disconnected"), and the client could not know whether it ran.
    # hypercorn's own default (5 s) equals httpx's and lost such requests.
    http_keep_alive_s: float = 75.0
    # A request's head (request line and headers) must arrive whole within
    # this of its first byte, or the connection is closed: a client sending
    # its head a byte at a time would otherwise hold a connection (and a slot
    # of limits.max_connections) for the whole keep-alive. A real client
    # sends its head in one write; 10 s covers the slowest link.
    http_header_timeout_s: float = 10.0
    # A probe of the database that has not answered after this long marks
    # the store down (503 STORE_UNAVAILABLE, /readyz 503), and the API calls
    # still waiting on the database are answered 503 at once: with the probe
    # every store_probe_s, a node cut off from its database answers every
    # request within about store_probe_s + this (under a second). Far above
    # a loaded group commit (6-10 ms, docs/benchmarks.md).
    store_probe_timeout_s: float = 0.5
    # ── PostgreSQL sessions (ironflow/store/pg_connect.py): every wait bounded ──
    # A statement running longer than this is cancelled by the server: the
    # store's statements take milliseconds, its purges are batched, so only a
    # runaway one (or one stuck sending to a vanished node) gets here.
    pg_statement_timeout_s: float = 30.0
    # A statement waiting this long for a lock gives up: a lock held by a
    # session that is not a node's (an operator's open psql transaction) is
    # bounded by nothing else. Above pg_idle_in_transaction_timeout_s, so a
    # lock held by a partitioned node is released (its session ended) first.
    pg_lock_timeout_s: float = 10.0
    # The server ends a node's session left idle inside a transaction this
    # long, releasing its locks: a node partitioned from the database mid
    # group never holds rows its peers need for longer. A group's statements
    # follow each other within milliseconds.
    pg_idle_in_transaction_timeout_s: float = 5.0
    # A node notices a dead connection to PostgreSQL within about this, with
    # data in flight (tcp_user_timeout) or not (TCP keepalives), instead of
    # the operating system's ~15 minutes of retransmissions.
    pg_tcp_timeout_s: float = 10.0


# Timings where 0 means "off" rather than "unsafe".
ZERO_MEANS_OFF = frozenset({"history_retention_s", "waker_lookahead_s", "ack_hold_s"})

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
    # A function is live while a worker serves it and this long after its
    # last worker left (ironflow/store/function_life.py): a cron function
    # not live starts no runs, its ticks recorded as skipped (NO_LIVE_WORKER).
    # Five minutes: above a worker's restart or a rolling deploy (and the 90 s
    # session expiry that notices a silent one), so those cost no tick; and a
    # per-second schedule whose workers never return queues at most ~300 runs.
    function_live_s: float = 300.0
    # The shortest interval between two ticks a cron trigger may ask for:
    # each tick is a transaction and a run. A schedule firing more often is
    # refused at registration, naming this setting (not silently stretched:
    # the run count would differ from the schedule the code declares).
    # 1 s, the finest a 6-field cron can ask for, refuses nothing by default.
    cron_min_interval_s: float = 1.0
    # Open connections (HTTP, websockets) one node keeps; past it a new one is
    # answered 503 and closed. Under the usual 1,024 open files per process
    # with room for the node's own (database, logs, listeners), so a flood of
    # connections is refused rather than leaving the node unable to open any.
    max_connections: int = 900
    # Result requests (``wait_s`` > 0) held open at once; past it one is
    # answered 429. Each holds a connection and a task for up to 300 s.
    max_held_waits: int = 500
    # A run's state: the JSON of its step outputs, all kept for its replays.
    # Past it the step that crosses it fails the run (RUN_STATE_TOO_LARGE, not
    # retried): one run may not grow the database or its replays without end.
    max_run_state_bytes: int = 64 * 1024 * 1024
    # Step outputs a later segment's assignment carries inline, in step order;
    # the rest the worker reads by step id when its handler reaches them, so
    # an assignment stays far below the frame limit however large the state.
    memo_inline_bytes: int = 1024 * 1024
    # Expressions (trigger filters, keys, priorities, cancel-on conditions) run
    # on the node's one thread for every event they judge: their size and
    # nesting are bounded at registration, and each evaluation's estimated
    # cost on the event at hand (ironflow/expressions.py) must be within the
    # budget, or the expression is not run (EXPRESSION_BUDGET_EXCEEDED).
    # Tokens one expression may have (a 4,096-character filter has ~1,000).
    expression_max_tokens: int = 1024
    # Brackets one inside another: the parser's own limit is ~100.
    expression_max_nesting: int = 32
    # Comprehensions (all, exists, exists_one, map, filter) one inside
    # another: each level multiplies the work by its list's length.
    expression_max_comprehension_depth: int = 2
    # Estimated microseconds one evaluation may take: the node's thread is
    # everyone's, and an emit judges each triggered function's expressions.
    # At the default an expression may read ~400 values of an event.
    expression_budget_us: float = 1000.0
    # Rows one page of a list route (events, runs, audit) may hold: a larger
    # ``limit`` is refused (422 LIMIT_EXCEEDED), not clamped, so a client that
    # reads one page never takes it for the whole list. The rest is paged by
    # ``next_cursor``, an index range scan each, however long the list.
    max_page_rows: int = 1000
    # Bytes of records one page may hold (the JSON of its records): the page
    # stops early, with a ``next_cursor``, at the row that would cross it. With
    # ``?include=data`` a page of big payloads would otherwise be rows × the
    # largest body (a page of 1,000 runs with 4 MiB outputs: ~4 GiB); at the
    # default one page is no larger than the largest body the node accepts.
    # A single row larger than the cap is still answered, alone on its page.
    max_page_bytes: int = MAX_FRAME_BYTES


class NodeConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a node needs to start."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # SQLite path or file URL, or a postgresql:// URL. None → .ironflow/ironflow.db
    db: str | None = None
    node_id: str | None = None
    dev: bool = False
    state_dir: str = DEFAULT_STATE_DIR
    max_frame_bytes: int = MAX_FRAME_BYTES
    idempotency_window_s: float = 24 * 3600.0
    # A new SQLite file gives purged pages back to the file system (it shrinks)
    # at ~10 % of write throughput; off, purged pages are reused instead.
    sqlite_auto_vacuum: bool = False
    log_level: str = "INFO"
    # Testing only: a platform key may crash this node's actors through
    # POST /v1/chaos/crash (scripts/chaos.py). Off, the chaos routes are 404.
    chaos: bool = False
    timings: Timings = msgspec.field(default_factory=Timings)
    limits: Limits = msgspec.field(default_factory=Limits)

    @property
    def database_url(self) -> str:
        """The database to open: ``db`` or the SQLite default under ``state_dir``."""
        return self.db or str(Path(self.state_dir) / "ironflow.db")

    @property
    def bootstrap_key_path(self) -> Path:
        """Where a ``--dev`` node writes its org admin key."""
        return Path(self.state_dir) / BOOTSTRAP_KEY_FILE

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
    "IRONFLOW_SQLITE_AUTO_VACUUM": "sqlite_auto_vacuum",
}


# The crash-recovery seed's own names for two loop-2 settings.
SEED_TIMING_NAMES = {
    "stale_claim_recovery_interval": "stale_claim_interval_s",
    "stale_claim_threshold": "stale_claim_threshold_s",
}
# A duration as the seed writes it: 90s, 2m, 1m30s, 250ms, 7d (units may repeat).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SECONDS_PER = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any, setting: str) -> float:
    """Seconds from ``90``, ``90.5``, ``"90"``, ``"90s"``, ``"2m"``, ``"1m30s"``, ``"250ms"``.

    Raises:
      ConfigError: naming ``setting`` and the value, when it is no duration.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ConfigError(
            f"{setting}={value!r} is not a duration (write e.g. 90, 90s, 2m, 1m30s or 250ms)"
        )
    return sum(float(number) * _SECONDS_PER[unit] for number, unit in parts)


def _timing_spellings() -> dict[str, str]:
    """Every accepted spelling of a timing (lower case, no prefix) → its field."""
    names: dict[str, str] = {}
    for field in Timings.__struct_fields__:
        names[field] = field
        if field.endswith("_s"):
            names[field[:-2]] = field
    names.update(SEED_TIMING_NAMES)
    return names


def _canonical_timings(given: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """``given`` keyed by canonical field; two spellings that disagree are an error
    (named as the user wrote them: ``prefix`` + the spelling, upper-cased for env)."""
    spellings = _timing_spellings()
    out: dict[str, Any] = {}
    seen_as: dict[str, str] = {}
    for key, value in given.items():
        field = spellings.get(key.lower())
        if field is None:
            out[key] = value  # unknown: msgspec names it in its own error
            continue
        if field in out and _as_number(out[field], field) != _as_number(value, field):
            first, second = (
                (prefix + name.upper()) if prefix else name for name in (seen_as[field], key)
            )
            raise ConfigError(
                f"{where}: {first}={out[field]!r} and {second}={value!r} set "
                f"timings.{field} to different values; keep one"
            )
        out[field], seen_as[field] = value, key
    return out


def _as_number(value: Any, field: str) -> float:
    return float(value) if field == "recovery_ceiling" else parse_duration(value, f"timings.{field}")


def _env_overrides(
    env: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    top: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    for var, field in _ENV_FIELDS.items():
        if var in env:
            top[field] = env[var]
    for field in Limits.__struct_fields__:
        var = "IRONFLOW_" + field.upper()
        if var in env:
            limits[field] = env[var]
    given = {
        name: env["IRONFLOW_" + name.upper()]
        for name in _timing_spellings()
        if "IRONFLOW_" + name.upper() in env
    }
    timings = _canonical_timings(given, "environment", prefix="IRONFLOW_")
    return top, timings, limits


def _parsed_timings(timings: dict[str, Any]) -> dict[str, Any]:
    """Every duration in seconds (the seed's forms accepted); the ceiling stays a count."""
    return {
        field: value if field not in Timings.__struct_fields__ or field == "recovery_ceiling"
        else parse_duration(value, f"timings.{field}")
        for field, value in timings.items()
    }


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
        timings.update(_canonical_timings(_section(raw, "timings"), f"config file {file}"))
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
    merged["timings"] = _parsed_timings(timings)
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
    if t.waker_lookahead_s > t.reservation_expiry_s / 2:
        # A worker that cannot hold a job is sent it at its start time: the
        # reservation must outlast that wait with room for the ack.
        raise ConfigError(
            f"timings.waker_lookahead_s={t.waker_lookahead_s:g}s must be at most half the "
            f"reservation expiry ({t.reservation_expiry_s:g}s)"
        )
    if t.pg_lock_timeout_s <= t.pg_idle_in_transaction_timeout_s:
        # A lock a partitioned node holds is released when the server ends its
        # idle session; a peer giving up on it sooner would fail for nothing.
        raise ConfigError(
            f"timings.pg_lock_timeout_s={t.pg_lock_timeout_s:g}s must be longer than "
            f"timings.pg_idle_in_transaction_timeout_s={t.pg_idle_in_transaction_timeout_s:g}s"
        )
    if t.restart_backoff_max_s < t.restart_backoff_s:
        raise ConfigError("timings.restart_backoff_max_s must be ≥ restart_backoff_s")
    if not 0 < config.port < 65536 and config.port != 0:
        raise ConfigError(f"port must be 0..65535, got {config.port}")
    if config.max_frame_bytes < 1024:
        raise ConfigError("max_frame_bytes must be at least 1024")
    _validate_limits(config.limits)
    if config.limits.memo_inline_bytes > config.max_frame_bytes // 2:
        raise ConfigError(
            f"limits.memo_inline_bytes ({config.limits.memo_inline_bytes}) must be at most half of "
            f"max_frame_bytes ({config.max_frame_bytes}): an assignment carries the event as well"
        )


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
    for field in ("max_connections", "max_held_waits"):
        if getattr(limits, field) < 1:
            raise ConfigError(f"limits.{field} must be at least 1, got {getattr(limits, field)}")
    for field in ("function_live_s", "cron_min_interval_s"):
        if getattr(limits, field) <= 0:
            raise ConfigError(f"limits.{field} must be positive, got {getattr(limits, field)}")
    for field in ("expression_max_tokens", "expression_max_nesting", "expression_max_comprehension_depth"):
        if getattr(limits, field) < 1:
            raise ConfigError(f"limits.{field} must be at least 1, got {getattr(limits, field)}")
    if limits.max_run_state_bytes < 1024:
        raise ConfigError(f"limits.max_run_state_bytes must be at least 1024, got {limits.max_run_state_bytes}")
    if not 0 <= limits.memo_inline_bytes <= MAX_FRAME_BYTES // 2:
        raise ConfigError(
            f"limits.memo_inline_bytes must be in 0..{MAX_FRAME_BYTES // 2} (half a frame), "
            f"got {limits.memo_inline_bytes}"
        )
    if limits.max_page_rows < 1:
        raise ConfigError(f"limits.max_page_rows must be at least 1, got {limits.max_page_rows}")
    if limits.max_page_bytes < MIN_PAGE_BYTES:
        raise ConfigError(
            f"limits.max_page_bytes must be at least {MIN_PAGE_BYTES} (a page of records without"
            f" their payloads), got {limits.max_page_bytes}"
        )
    if limits.expression_budget_us < 50:
        # Below it even `event.data.x == 1` would be refused: the call alone costs ~5 µs.
        raise ConfigError(f"limits.expression_budget_us must be at least 50, got {limits.expression_budget_us}")
