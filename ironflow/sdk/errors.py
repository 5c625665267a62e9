"""Errors a handler raises or catches, and how each maps onto the wire.

Every ``IronflowError`` carries a stable ``code`` and a ``retryable`` flag; the
job runner turns an exception escaping a handler into ``ErrorInfo`` with
those two values. A plain exception is ``ERROR``, retryable.
"""

from __future__ import annotations


class IronflowError(Exception):
    """Base class: ``code`` names the failure, ``retryable`` says whether to retry."""

    code: str = "ERROR"
    retryable: bool = True

    def __init__(self, message: str = "", *, code: str | None = None, retryable: bool | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable


class NonRetryableError(IronflowError):
    """Fail the run now: no retry is attempted."""

    code = "NON_RETRYABLE"
    retryable = False


class SerializationError(NonRetryableError):
    """A step output, handler output or yield payload is not strict JSON."""

    code = "SERIALIZATION_ERROR"


class StepOutputTooLargeError(NonRetryableError):
    """A step output larger than the engine reads in one frame
    (``Registered.max_frame_bytes``): it would fail the same way on every retry."""

    code = "STEP_OUTPUT_TOO_LARGE"


class WrongEventLoopError(NonRetryableError):
    """A step body awaited an API of another event loop than the worker's
    (asyncio code on a Trio worker): it would fail the same way on every retry."""

    code = "WRONG_EVENT_LOOP"


class StepError(IronflowError):
    """A ``step.run`` body raised; the original exception is ``__cause__``.

    Retryable unless the body raised a non-retryable ``IronflowError``, whose
    code it then carries.
    """

    code = "STEP_FAILED"

    def __init__(
        self,
        message: str,
        *,
        step_id: str,
        name: str,
        code: str | None = None,
        retryable: bool | None = None,
    ):
        super().__init__(message, code=code, retryable=retryable)
        self.step_id = step_id
        self.name = name


class StepTimeoutError(IronflowError):
    """A step exceeded its timeout. Retryable."""

    code = "STEP_TIMEOUT"


class InvokeError(IronflowError):
    """A child run started by ``step.invoke`` failed or timed out. Never retried."""

    code = "INVOKE_FAILED"
    retryable = False


class WorkerAuthError(IronflowError):
    """The engine refused the worker's credentials (HTTP 401/403): no reconnect."""

    code = "UNAUTHENTICATED"
    retryable = False


class RegistrationRefusedError(IronflowError):
    """The engine refused the worker's registration (a limit, an invalid
    definition): reconnecting would be refused again, so the worker stops."""

    code = "REGISTRATION_REFUSED"


class RunFailedError(IronflowError):
    """The awaited run ended without an output: it failed or was cancelled.

    ``code`` and ``message`` are the run's error; ``status`` is ``failed`` or
    ``cancelled``.
    """

    def __init__(self, run_id: str, status: str, code: str, message: str):
        super().__init__(f"run {run_id} {status}: {code}: {message}", code=code, retryable=False)
        self.run_id = run_id
        self.status = status


class IronflowAPIError(IronflowError):
    """The HTTP API answered 4xx/5xx: ``status``, the server's ``code`` and ``message``."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}", code=code, retryable=status >= 500)
        self.status = status
        self.message = message
