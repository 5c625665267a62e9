"""The schema as nodes created it before numbered migrations, frozen for the
upgrade tests (``test_schema_migrations.py``): the DDL module of that version,
and the start that applied it (every start, idempotent; on PostgreSQL skipped
when ``schema_state`` held its fingerprint). Never edited: it is what
databases in the field were made by.
"""

from __future__ import annotations

import hashlib

# Arbitrary constant: the advisory lock that serialises schema creation when
# several nodes start against one PostgreSQL at once.
SCHEMA_LOCK_KEY = 0x1F0F10

_DDL = """
CREATE TABLE IF NOT EXISTS functions (
    id          TEXT PRIMARY KEY,
    definition  TEXT NOT NULL,
    audit       INTEGER NOT NULL DEFAULT 0,
    version     INTEGER NOT NULL,
    updated_at  {REAL} NOT NULL,
    last_seen_at {REAL}
);

-- The trigger index: an emit reads the functions its event name can trigger
-- (the exact name and each "prefix.*" above it), never every definition.
CREATE TABLE IF NOT EXISTS function_triggers (
    pattern      TEXT NOT NULL,
    function_id  TEXT NOT NULL,
    PRIMARY KEY (pattern, function_id)
);
CREATE INDEX IF NOT EXISTS function_triggers_function ON function_triggers (function_id);

CREATE TABLE IF NOT EXISTS events (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    data            TEXT NOT NULL,
    idempotency_key TEXT,
    received_at     {REAL} NOT NULL,
    run_ids         TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS events_idempotency ON events (idempotency_key, received_at)
    WHERE idempotency_key IS NOT NULL;
-- The janitor finds events past the idempotency window by age, and GET
-- /v1/events pages newest first by (received_at, id) (store/pages.py).
CREATE INDEX IF NOT EXISTS events_page ON events (received_at, id);

CREATE TABLE IF NOT EXISTS runs (
    id                    TEXT PRIMARY KEY,
    function_id           TEXT NOT NULL,
    event_id              TEXT,
    parent_run_id         TEXT,
    parent_step_id        TEXT,
    status                TEXT NOT NULL,
    attempt               INTEGER NOT NULL DEFAULT 1,
    max_attempts          INTEGER NOT NULL,
    recovery_count        INTEGER NOT NULL DEFAULT 0,
    current_execution_seq INTEGER NOT NULL DEFAULT 1,
    concurrency_key       TEXT,
    timeout_s             {REAL},
    deadline_at           {REAL},
    -- When the run's next segment may start its handler (the wake time of a
    -- sleep resumed ahead of it): every dispatch of the run honours it.
    start_at              {REAL},
    output                TEXT,
    error                 TEXT,
    created_at            {REAL} NOT NULL,
    started_at            {REAL},
    ended_at              {REAL},
    updated_at            {REAL} NOT NULL
);
-- GET /v1/runs pages newest first by (created_at, id), all runs or one
-- status or one function's (store/pages.py). The status index serves the
-- bulk resume and the janitor as well.
CREATE INDEX IF NOT EXISTS runs_page ON runs (created_at, id);
CREATE INDEX IF NOT EXISTS runs_status_page ON runs (status, created_at, id);
CREATE INDEX IF NOT EXISTS runs_function_page ON runs (function_id, created_at, id);
CREATE INDEX IF NOT EXISTS runs_parent ON runs (parent_run_id) WHERE parent_run_id IS NOT NULL;
-- The janitor keeps an event while any run references it, and finds finished
-- runs past retention by their end time (only finished runs are indexed).
CREATE INDEX IF NOT EXISTS runs_event ON runs (event_id);
CREATE INDEX IF NOT EXISTS runs_ended ON runs (ended_at)
    WHERE status IN ('completed', 'failed', 'cancelled');

CREATE TABLE IF NOT EXISTS steps (
    run_id            TEXT NOT NULL,
    step_id           TEXT NOT NULL,
    name              TEXT NOT NULL,
    kind              TEXT NOT NULL,
    status            TEXT NOT NULL,
    output            TEXT,
    error             TEXT,
    duration_ms       {REAL},
    execution_seq     INTEGER NOT NULL,
    created_at        {REAL} NOT NULL,
    seq               BIGINT NOT NULL DEFAULT 0,
    wake_at           {REAL},
    wait_event        TEXT,
    wait_match        TEXT,
    wait_match_value  TEXT,
    invoke_run_id     TEXT,
    claimed_by        TEXT,
    claimed_at        {REAL},
    pre_claim_status  TEXT,
    PRIMARY KEY (run_id, step_id)
);
CREATE INDEX IF NOT EXISTS steps_wake ON steps (wake_at)
    WHERE status IN ('sleeping', 'waiting') AND wake_at IS NOT NULL;
-- The earliest sleep alone: the waker claims sleeps ahead of their wake time
-- (waits only at it), so it needs each kind's earliest without a scan.
CREATE INDEX IF NOT EXISTS steps_sleep_wake ON steps (wake_at) WHERE status = 'sleeping';
-- ... and the earliest wait or invoke timeout, which steps_wake reached only
-- after passing every sleeping row ahead of it (20k sleeps: 13 ms a call).
CREATE INDEX IF NOT EXISTS steps_wait_wake ON steps (wake_at)
    WHERE status = 'waiting' AND wake_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS steps_waking ON steps (claimed_at) WHERE status = 'waking';
-- Every match path waited on for an event name (ironflow/store/waits.py): an
-- ingest computes the wait keys its event satisfies from these few rows.
CREATE TABLE IF NOT EXISTS wait_paths (
    wait_event  TEXT NOT NULL,
    wait_match  TEXT NOT NULL,
    PRIMARY KEY (wait_event, wait_match)
);

CREATE TABLE IF NOT EXISTS dispatch_queue (
    run_id                  TEXT PRIMARY KEY,
    execution_seq           INTEGER NOT NULL,
    function_id             TEXT NOT NULL,
    concurrency_key         TEXT,
    eligible_at             {REAL} NOT NULL,
    reason                  TEXT NOT NULL,
    enqueued_at             {REAL} NOT NULL,
    reservation_owner       TEXT,
    reservation_expires_at  {REAL},
    lease_token_hash        TEXT
);
CREATE INDEX IF NOT EXISTS dispatch_queue_eligible ON dispatch_queue (eligible_at, enqueued_at)
    WHERE reservation_owner IS NULL;
CREATE INDEX IF NOT EXISTS dispatch_queue_reservation ON dispatch_queue (reservation_expires_at)
    WHERE reservation_owner IS NOT NULL;

CREATE TABLE IF NOT EXISTS concurrency_leases (
    run_id            TEXT PRIMARY KEY,
    execution_seq     INTEGER NOT NULL,
    function_id       TEXT NOT NULL,
    concurrency_key   TEXT,
    session_id        TEXT NOT NULL,
    node_id           TEXT NOT NULL,
    lease_token_hash  TEXT NOT NULL,
    expires_at        {REAL} NOT NULL,
    activated_at      {REAL} NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_expires ON concurrency_leases (expires_at);
CREATE INDEX IF NOT EXISTS leases_session ON concurrency_leases (session_id);
CREATE INDEX IF NOT EXISTS leases_function ON concurrency_leases (function_id, concurrency_key);

CREATE TABLE IF NOT EXISTS worker_sessions (
    id                   TEXT PRIMARY KEY,
    worker_id            TEXT NOT NULL,
    node_id              TEXT NOT NULL,
    mode                 TEXT NOT NULL,
    max_concurrent_jobs  INTEGER NOT NULL,
    draining             INTEGER NOT NULL DEFAULT 0,
    function_ids         TEXT NOT NULL,
    hostname             TEXT NOT NULL DEFAULT '',
    created_at           {REAL} NOT NULL,
    expires_at           {REAL} NOT NULL,
    secret_hash          TEXT
);
CREATE INDEX IF NOT EXISTS sessions_expires ON worker_sessions (expires_at);

-- The functions each worker session serves (ironflow/store/function_life.py):
-- a function is live while a session of it has not expired. Written with the
-- session, deleted with it.
CREATE TABLE IF NOT EXISTS session_functions (
    function_id  TEXT NOT NULL,
    session_id   TEXT NOT NULL,
    PRIMARY KEY (function_id, session_id)
);
CREATE INDEX IF NOT EXISTS session_functions_session ON session_functions (session_id);

CREATE TABLE IF NOT EXISTS worker_credits (
    session_id             TEXT NOT NULL REFERENCES worker_sessions (id) ON DELETE CASCADE,
    slot                   INTEGER NOT NULL,
    claimed_run_id         TEXT,
    claimed_execution_seq  INTEGER,
    held                   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, slot)
);
CREATE INDEX IF NOT EXISTS credits_claim ON worker_credits (claimed_run_id)
    WHERE claimed_run_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS nodes (
    id            TEXT PRIMARY KEY,
    started_at    {REAL} NOT NULL,
    heartbeat_at  {REAL} NOT NULL
);

CREATE TABLE IF NOT EXISTS audit_log (
    id           TEXT PRIMARY KEY,
    at           {REAL} NOT NULL,
    type         TEXT NOT NULL,
    run_id       TEXT,
    function_id  TEXT,
    data         TEXT NOT NULL
);
-- GET /v1/audit pages oldest first by (at, id): all of it, one run's or one
-- type's (store/pages.py).
CREATE INDEX IF NOT EXISTS audit_page ON audit_log (at, id);
CREATE INDEX IF NOT EXISTS audit_run_page ON audit_log (run_id, at, id);
CREATE INDEX IF NOT EXISTS audit_type_page ON audit_log (type, at, id);

-- One row at most, inserted and deleted in one transaction by the outage
-- probe (ironflow/store/outage.py): proves the database can grow again.
CREATE TABLE IF NOT EXISTS store_probe (
    id   INTEGER PRIMARY KEY,
    pad  TEXT NOT NULL
);

-- How far every node's blind time has been given back (ironflow/store/outage.py):
-- one row. A node back from an outage extends only the part of its blind
-- interval after it, so two nodes blind through one outage extend it once.
CREATE TABLE IF NOT EXISTS blind_time (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    given_until  {REAL} NOT NULL
);
-- The row exists before any give-back, so its FOR UPDATE always has a row to
-- lock: two nodes back from one outage take turns.
INSERT INTO blind_time (id, given_until) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;

CREATE TABLE IF NOT EXISTS api_keys (
    id          TEXT PRIMARY KEY,
    kind        TEXT NOT NULL,
    role        TEXT NOT NULL,
    key_hash    TEXT NOT NULL UNIQUE,
    created_at  {REAL} NOT NULL
);

-- ── cron triggers (ironflow/store/cron.py, docs/schedules.md) ──
-- One row per cron trigger of a function. next_at is the one "last tick
-- considered" every node agrees on: the earliest tick not yet fired or
-- skipped. A tick is due when next_at <= ironflow_now().
CREATE TABLE IF NOT EXISTS cron_schedules (
    function_id       TEXT NOT NULL,
    cron              TEXT NOT NULL,
    timezone          TEXT NOT NULL,
    catchup           TEXT NOT NULL,
    catchup_window_s  {REAL} NOT NULL,
    next_at           {REAL} NOT NULL,
    PRIMARY KEY (function_id, cron, timezone)
);
CREATE INDEX IF NOT EXISTS cron_schedules_next ON cron_schedules (next_at);
-- The claim of a tick: its primary key makes one run per function and
-- scheduled time, whatever the nodes, restarts or clocks.
CREATE TABLE IF NOT EXISTS cron_ticks (
    function_id   TEXT NOT NULL,
    scheduled_at  {REAL} NOT NULL,
    -- The tick's ironflow.cron event: its run is the run of that event.
    event_id      TEXT NOT NULL,
    node_id       TEXT NOT NULL,
    claimed_at    {REAL} NOT NULL,
    PRIMARY KEY (function_id, scheduled_at)
);

-- Cancel on an event (ironflow/store/cancel_on.py): one row per live run and
-- cancel_on entry, keyed by what cancels it (event name, match path, the
-- canonical value its triggering event holds there): an emit looks up exactly
-- the keys its event carries. A row whose run ended is deleted by the next
-- event that finds it, or with its run.
CREATE TABLE IF NOT EXISTS cancel_subscriptions (
    cancel_key  TEXT NOT NULL,
    run_id      TEXT NOT NULL,
    spec        INTEGER NOT NULL,
    condition   TEXT,
    expires_at  {REAL},
    PRIMARY KEY (cancel_key, run_id, spec)
);
CREATE INDEX IF NOT EXISTS cancel_subscriptions_run ON cancel_subscriptions (run_id);
-- Every match path a cancel_on of a registered function names, per event name:
-- an emit computes the cancel keys of its event from these few rows.
CREATE TABLE IF NOT EXISTS cancel_paths (
    event_name  TEXT NOT NULL,
    match_path  TEXT NOT NULL,
    PRIMARY KEY (event_name, match_path)
);
-- Ingest-side flow control (ironflow/store/flow.py, docs/flow-control.md).
-- Each table is keyed by (function, key): an ingest's upsert of that row is
-- the lock two nodes ingesting the same key take turns on.
-- A rate limit's GCRA state: the theoretical arrival time of the next event.
CREATE TABLE IF NOT EXISTS rate_limits (
    function_id  TEXT NOT NULL,
    key          TEXT NOT NULL,
    tat          {REAL} NOT NULL,
    PRIMARY KEY (function_id, key)
);
-- A debounce's pending run: its queue row is due at fire_at (first_at bounds
-- it by max_wait). The run carries the last event.
CREATE TABLE IF NOT EXISTS debounces (
    function_id  TEXT NOT NULL,
    key          TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    event_id     TEXT NOT NULL,
    first_at     {REAL} NOT NULL,
    fire_at      {REAL} NOT NULL,
    PRIMARY KEY (function_id, key)
);
-- A singleton key's run in flight (or its last one, ended).
CREATE TABLE IF NOT EXISTS singletons (
    function_id  TEXT NOT NULL,
    key          TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    PRIMARY KEY (function_id, key)
);
-- A batch being filled: its run, due at first_at + timeout, and its size.
CREATE TABLE IF NOT EXISTS batches (
    function_id  TEXT NOT NULL,
    key          TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    first_at     {REAL} NOT NULL,
    size         INTEGER NOT NULL,
    PRIMARY KEY (function_id, key)
);
-- The events of a batch run, in arrival order.
CREATE TABLE IF NOT EXISTS batch_events (
    run_id    TEXT NOT NULL,
    position  INTEGER NOT NULL,
    event_id  TEXT NOT NULL,
    PRIMARY KEY (run_id, position)
);
-- Retention keeps an event a kept batch run still holds (ironflow/store/history.py).
CREATE INDEX IF NOT EXISTS batch_events_event ON batch_events (event_id);
-- Flow control, dispatch side (ironflow/store/flow.py): one GCRA
-- state per throttled function and key — the theoretical arrival time of the
-- next start, by ironflow_now(). The key is '' for none, 'k:<text>' otherwise.
CREATE TABLE IF NOT EXISTS flow_throttle (
    function_id   TEXT NOT NULL,
    throttle_key  TEXT NOT NULL,
    tat           {REAL} NOT NULL,
    PRIMARY KEY (function_id, throttle_key)
);
-- A concurrency key whose on_limit (skip, cancel_in_progress) is decided at
-- ingest (ironflow/store/flow.py): no state, only the row an ingest's upsert
-- locks, so two nodes ingesting one key count its runs in flight in turn.
-- The key is '' for none, 'k:<text>' otherwise.
CREATE TABLE IF NOT EXISTS on_limit_keys (
    function_id      TEXT NOT NULL,
    concurrency_key  TEXT NOT NULL,
    PRIMARY KEY (function_id, concurrency_key)
);
"""

_PG_EXTRA = """
-- The fingerprint of the schema last applied: a node (re)starting beside
-- running ones finds it current and takes no table lock at all.
CREATE TABLE IF NOT EXISTS schema_state (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    fingerprint  TEXT NOT NULL
);
"""

# The database clock on PostgreSQL: transaction time, plus a skew that only
# tests set (``tests/clock.py`` re-creates the function with the skew as a
# literal; production creates it with 0). A literal, not a read of a table: a
# body without a subquery is inlined into every statement that calls it, where
# a subquery made each call a separate SQL-function execution (~80 µs of
# server CPU each, a dozen calls per run). Re-creating the function
# invalidates every cached plan that inlined the old one.
def pg_now_function(skew: float) -> str:
    """The ``CREATE OR REPLACE`` of ``ironflow_now()`` with ``skew`` seconds added."""
    return (
        "CREATE OR REPLACE FUNCTION ironflow_now() RETURNS double precision\n"
        "LANGUAGE sql STABLE AS $$\n"
        f"    SELECT extract(epoch FROM now())::double precision + ({float(skew)!r})::double precision\n"
        "$$"
    )


PG_NOW_FUNCTION = pg_now_function(0.0)

# The database clock at this instant, not at the transaction's start (what
# ``now()``, and so ``ironflow_now()``, reads on PostgreSQL): for a start delay
# computed in a long group transaction. Defined on ``ironflow_now()``, so it
# follows a test's skew. On SQLite ``ironflow_now()`` already reads the clock
# at each call, and the store registers this name for it too.
PG_CLOCK_FUNCTION = (
    "CREATE OR REPLACE FUNCTION ironflow_clock() RETURNS double precision\n"
    "LANGUAGE sql VOLATILE AS $$\n"
    "    SELECT ironflow_now() + (extract(epoch FROM clock_timestamp())"
    " - extract(epoch FROM now()))::double precision\n"
    "$$"
)


# Columns added after a table was first shipped: (table, column, type). A
# database created by an older version gets them on start (CREATE TABLE IF NOT
# EXISTS leaves an existing table as it was).
_ADDED_COLUMNS = [
    ("functions", "last_seen_at", "{REAL}"),
    ("worker_sessions", "secret_hash", "TEXT"),
    ("runs", "timeout_s", "{REAL}"),
    ("runs", "deadline_at", "{REAL}"),
    ("runs", "start_at", "{REAL}"),
    # A parked wait's key (ironflow/store/waits.py: wait_key).
    ("steps", "wait_key", "TEXT"),
    # The inserting transaction's id (PostgreSQL), which a wait's look-back
    # judges against the snapshot of its segment's reservation.
    ("events", "xid", "BIGINT"),
    # When the segment began: its reservation, after which the worker may start
    # the handler (it need not wait for its JobAck to commit). The look-back of
    # a wait parked by the segment starts there (waits.py).
    ("dispatch_queue", "reserved_at", "{REAL}"),
    ("dispatch_queue", "reservation_snapshot", "TEXT"),
    ("concurrency_leases", "began_at", "{REAL}"),
    ("concurrency_leases", "began_snapshot", "TEXT"),
    # The W3C traceparent its runs' spans descend from (ironflow/store/ingest.py).
    ("events", "traceparent", "TEXT"),
    # Function pause (ironflow/store/cron.py): when it was paused, NULL = not paused.
    ("functions", "paused_at", "{REAL}"),
    # Trigger filters and cancel-on: the functions an event did not start and
    # why, the runs it cancelled (ironflow/store/filters.py); NULL for neither.
    ("events", "notes", "TEXT"),
    # Ingest-side flow control (ironflow/store/flow.py): what it did with an
    # event (JSON FlowNotes), and 1 on a batch run (its events: batch_events).
    ("events", "flow", "TEXT"),
    ("runs", "batch_size", "INTEGER"),
    # Flow control, dispatch side : seconds a queued segment starts
    # ahead of its place (its priority, ±600); the order is eligible_at - priority_s.
    ("dispatch_queue", "priority_s", "{REAL} NOT NULL DEFAULT 0"),
    # Compensation (ironflow/store/compensation.py): what began the run's undos
    # ('failure' or 'cancel'); NULL until then.
    ("runs", "compensation", "TEXT"),
    # A function deleted by an operator (ironflow/store/function_life.py): its
    # definition kept for its runs' history; NULL = not deleted.
    ("functions", "deleted_at", "{REAL}"),
    # A schedule's last tick considered and, when it started no run, why
    # (NO_LIVE_WORKER, PAUSED, MISSED), how many ticks in a row, and the first
    # skipped for lack of a live worker (its catch-up anchor; store/cron.py).
    ("cron_schedules", "last_tick_at", "{REAL}"),
    ("cron_schedules", "skip_reason", "TEXT"),
    ("cron_schedules", "skipped_ticks", "INTEGER NOT NULL DEFAULT 0"),
    ("cron_schedules", "skipped_since", "{REAL}"),
]

# Fills the trigger index from stored definitions, for a database whose
# functions were registered before the index existed. Idempotent.
_BACKFILL_TRIGGERS = {
    "sqlite": "INSERT OR IGNORE INTO function_triggers (pattern, function_id)"
    " SELECT json_extract(t.value, '$.event'), f.id"
    " FROM functions f, json_each(f.definition, '$.triggers') t"
    " WHERE json_extract(t.value, '$.event') IS NOT NULL",
    "postgres": "INSERT INTO function_triggers (pattern, function_id)"
    " SELECT t ->> 'event', f.id FROM functions f,"
    " jsonb_array_elements(coalesce(f.definition::jsonb -> 'triggers', '[]'::jsonb)) t"
    " WHERE t ->> 'event' IS NOT NULL ON CONFLICT DO NOTHING",
}


def added_columns(dialect: str) -> list[tuple[str, str, str]]:
    """``(table, column, type)`` for each column a pre-existing table may lack."""
    real = "DOUBLE PRECISION" if dialect == "postgres" else "REAL"
    return [(t, c, kind.replace("{REAL}", real)) for t, c, kind in _ADDED_COLUMNS]


# Indexes on added columns: created after the columns exist (an old database gets
# the columns first). Runs past their function's timeout, among unended runs.
_LATE_INDEXES = [
    "CREATE INDEX IF NOT EXISTS runs_deadline ON runs (deadline_at) WHERE deadline_at IS NOT NULL"
    " AND status NOT IN ('completed', 'failed', 'cancelled')",
    # The waits an event satisfies, by key (waits.py); the name alone was read whole.
    "CREATE INDEX IF NOT EXISTS steps_wait_key ON steps (wait_key)"
    " WHERE status = 'waiting' AND kind = 'wait'",
    "DROP INDEX IF EXISTS steps_wait_event",
    # Each extended by the id (store/pages.py: the keyset order): the *_page
    # index with the same leading columns replaces it.
    "DROP INDEX IF EXISTS events_received",
    "DROP INDEX IF EXISTS runs_status",
    "DROP INDEX IF EXISTS runs_function",
    "DROP INDEX IF EXISTS audit_run",
    "DROP INDEX IF EXISTS audit_type",
    # Flow control, dispatch side (store/flow.py): the queue in
    # dispatch order (priority), and per function and concurrency key, for the
    # round robin across keys (a skip scan of the keys, then each key's head).
    "CREATE INDEX IF NOT EXISTS dispatch_queue_order ON dispatch_queue"
    " ((eligible_at - priority_s), enqueued_at) WHERE reservation_owner IS NULL",
    "CREATE INDEX IF NOT EXISTS dispatch_queue_key_order ON dispatch_queue"
    " (function_id, concurrency_key, (eligible_at - priority_s))"
    " WHERE reservation_owner IS NULL",
]
# SQLite only: each function's unreserved queue rows in dispatch order, so the
# reservation's candidate read (dispatch.py) of one function walks its first
# rows and stops at the LIMIT. Without it SQLite (no statistics) reads them
# through dispatch_queue_key_order and sorts every eligible row first: ~1–1.4 ms
# against ~45 µs with 1,000 rows queued (docs/benchmarks.md). PostgreSQL keeps
# its plan (not measured here).
_FUNCTION_ORDER_INDEX = {
    "sqlite": ["CREATE INDEX IF NOT EXISTS dispatch_queue_function_order ON dispatch_queue"
               " (function_id, (eligible_at - priority_s), enqueued_at) WHERE reservation_owner IS NULL"],
    "postgres": [],
}
# A wait's look-back: the events of its name committed after its segment began
# (PostgreSQL: by transaction id; SQLite: by arrival, its commit order). The
# events of one name newest first, paged by (received_at, id) (store/pages.py):
# on SQLite the same index.
_LOOKBACK_INDEX = {
    "sqlite": ["CREATE INDEX IF NOT EXISTS events_name_page ON events (name, received_at, id)",
               "DROP INDEX IF EXISTS events_name_received"],
    "postgres": ["CREATE INDEX IF NOT EXISTS events_name_xid ON events (name, xid) WHERE xid IS NOT NULL",
                 "CREATE INDEX IF NOT EXISTS events_name_page ON events (name, received_at, id)"],
}
# What the backfill of an older database computes for a wait parked before
# wait keys existed (the value text as it was stored, "null" for a missing one).
WAIT_KEY_BACKFILL = {
    dialect: (
        f"UPDATE steps SET wait_key = wait_event || {sep} || coalesce(wait_match, '') || {sep}"
        " || CASE WHEN wait_match IS NULL THEN '' ELSE coalesce(wait_match_value, 'null') END"
        " WHERE status = 'waiting' AND kind = 'wait' AND wait_key IS NULL"
    )
    for dialect, sep in (("sqlite", "char(31)"), ("postgres", "chr(31)"))
}
WAIT_PATHS_BACKFILL = {
    "sqlite": "INSERT OR IGNORE INTO wait_paths (wait_event, wait_match)"
    " SELECT DISTINCT wait_event, coalesce(wait_match, '') FROM steps"
    " WHERE status = 'waiting' AND kind = 'wait'",
    "postgres": "INSERT INTO wait_paths (wait_event, wait_match)"
    " SELECT DISTINCT wait_event, coalesce(wait_match, '') FROM steps"
    " WHERE status = 'waiting' AND kind = 'wait' ON CONFLICT DO NOTHING",
}





# The functions of sessions opened before session_functions existed. Idempotent.
SESSION_FUNCTIONS_BACKFILL = {
    "sqlite": "INSERT OR IGNORE INTO session_functions (function_id, session_id)"
    " SELECT j.value, s.id FROM worker_sessions s, json_each(s.function_ids) j",
    "postgres": "INSERT INTO session_functions (function_id, session_id)"
    " SELECT j, s.id FROM worker_sessions s, jsonb_array_elements_text(s.function_ids::jsonb) j"
    " ON CONFLICT DO NOTHING",
}


def backfill_statements(dialect: str) -> list[str]:
    """Statements run after the DDL and column additions, on every start."""
    return [
        *_LATE_INDEXES, *_FUNCTION_ORDER_INDEX[dialect], *_LOOKBACK_INDEX[dialect], _BACKFILL_TRIGGERS[dialect],
        WAIT_KEY_BACKFILL[dialect], WAIT_PATHS_BACKFILL[dialect], SESSION_FUNCTIONS_BACKFILL[dialect],
    ]


def statements(dialect: str) -> list[str]:
    """The DDL statements for ``dialect`` (``"sqlite"`` or ``"postgres"``), in order."""
    real = "DOUBLE PRECISION" if dialect == "postgres" else "REAL"
    text = _DDL.replace("{REAL}", real)
    if dialect == "postgres":
        text += _PG_EXTRA
    out = [s.strip() for s in text.split(";") if s.strip()]
    if dialect == "postgres":
        out.append(PG_NOW_FUNCTION.strip())
        out.append(PG_CLOCK_FUNCTION)
    return out


def fingerprint(dialect: str) -> str:
    """A digest of everything a start applies for ``dialect``: equal digests,
    nothing to apply (what the PostgreSQL store records in ``schema_state``)."""
    parts = [
        *statements(dialect),
        *(f"{t}.{c} {k}" for t, c, k in added_columns(dialect)),
        *backfill_statements(dialect),
    ]
    return hashlib.sha256("\n;\n".join(parts).encode()).hexdigest()


def build_sqlite(path: str, *, columns: bool = True) -> None:
    """Make the SQLite file at ``path`` as that version's start did; with
    ``columns`` false, as its first release did (no added column, no backfill)."""
    import sqlite3
    import time

    conn = sqlite3.connect(path, isolation_level=None)
    conn.create_function("ironflow_now", 0, time.time)
    conn.execute("BEGIN IMMEDIATE")
    for stmt in statements("sqlite"):
        conn.execute(stmt)
    if columns:
        for table, column, kind in added_columns("sqlite"):
            have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        for stmt in backfill_statements("sqlite"):
            conn.execute(stmt)
    conn.execute("COMMIT")
    conn.close()


def build_postgres(url: str, *, columns: bool = True) -> None:
    """Make the PostgreSQL database at ``url`` as that version's start did
    (fingerprint included); ``columns`` as in :func:`build_sqlite`."""
    import psycopg

    with psycopg.connect(url) as conn, conn.transaction(), conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
        for stmt in statements("postgres"):
            cur.execute(stmt)
        if columns:
            for table, column, kind in added_columns("postgres"):
                cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}")
            for stmt in backfill_statements("postgres"):
                cur.execute(stmt)
            cur.execute(
                "INSERT INTO schema_state (id, fingerprint) VALUES (1, %s)"
                " ON CONFLICT (id) DO UPDATE SET fingerprint = excluded.fingerprint",
                (fingerprint("postgres"),),
            )
