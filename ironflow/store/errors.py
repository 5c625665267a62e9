"""The errors the store raises on purpose; ``code`` is API-stable (the API maps
each to an HTTP status, ``ironflow/api/errors.py``). Re-exported by
``ironflow.store.base`` and ``ironflow.store``."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises on purpose. ``code`` is API-stable."""

    code = "STORE_ERROR"


class StaleExecution(StoreError):
    """The fence ``(run_id, execution_seq, lease_token)`` is not the live one."""

    code = "STALE_EXECUTION"


class NotFound(StoreError):
    code = "NOT_FOUND"


class FunctionNotFound(NotFound):
    code = "FUNCTION_NOT_FOUND"


class RunNotFound(NotFound):
    code = "RUN_NOT_FOUND"


class StepNotFound(NotFound):
    code = "STEP_NOT_FOUND"


class SessionNotFound(NotFound):
    """The worker session expired or was closed; the worker must re-register."""

    code = "SESSION_NOT_FOUND"


class Conflict(StoreError):
    code = "CONFLICT"


class LimitExceeded(StoreError):
    """A request would exceed one of the node's configured resource limits."""

    code = "LIMIT_EXCEEDED"


class InvalidCursor(StoreError):
    """A page cursor this list did not hand out (malformed, altered, or another
    list's): the caller starts again without one."""

    code = "INVALID_CURSOR"


class KeyEvaluationFailed(StoreError):
    """A function's key expression failed on the event that would start a run
    (docs/triggers.md): the run is not created; the message says why."""

    code = "KEY_EVALUATION_FAILED"


class StoreUnavailable(StoreError):
    """The database cannot be reached or cannot write (an outage, not a fault):
    the call did not take effect, or its commit is unknown; the same call may
    be made again once the store is back (``ironflow/store/availability.py``).
    The message names the cause."""

    code = "STORE_UNAVAILABLE"


class StoreTimeout(StoreError):
    """The database ended a statement at one of the node's bounds
    (``timings.pg_statement_timeout_s``, ``pg_lock_timeout_s``): it ran, or
    waited for a lock, too long. Nothing of the call was committed; the
    database itself is up (not an outage). The message names the bound."""

    code = "STORE_TIMEOUT"


class CommitOutcomeUnknown(StoreUnavailable):
    """The connection failed while the transaction committed: it may have
    committed or not. Never retried as if it had not (a write without an
    idempotency key would be written twice). An outage like any other for
    the node's availability (the connection broke), but its own code."""

    code = "COMMIT_OUTCOME_UNKNOWN"


class StorageFull(StoreUnavailable):
    """The database's disk (or its configured size limit) is full."""

    code = "STORAGE_FULL"


class StoreReadOnly(StoreError):
    """The database only reads (a standby, ``default_transaction_read_only``):
    raised by :meth:`Store.open`, which a node must not start on."""

    code = "STORE_READ_ONLY"
