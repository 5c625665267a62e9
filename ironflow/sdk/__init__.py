"""The worker SDK: declare functions, run them in a worker, emit events.

Imports ``ironflow.protocol`` only — never the store, actors or API — so a
worker process loads no database or server code.
"""

from ironflow.protocol import Concurrency, RetryPolicy, Trigger
from ironflow.protocol import EventInfo as Event
from ironflow.sdk.client import Ironflow, IronflowSync
from ironflow.sdk.client import IronflowSync as SyncClient
from ironflow.sdk.context import Context, RunInfo, Step, StepInfo, step_info
from ironflow.sdk.errors import (
    InvokeError,
    IronflowAPIError,
    IronflowError,
    NonRetryableError,
    RegistrationRefusedError,
    RunFailedError,
    SerializationError,
    StepError,
    StepOutputTooLargeError,
    StepTimeoutError,
    WorkerAuthError,
)
from ironflow.sdk.flow import Batch, Debounce, RateLimit, Singleton
from ironflow.sdk.function import (
    CancelOn,
    Function,
    Throttle,
    cron,
    event,
    function,
    parse_duration,
)
from ironflow.sdk.pull import PullWorker
from ironflow.sdk.streaming import StreamingWorker

__all__ = [
    "Batch",
    "CancelOn",
    "Debounce",
    "RateLimit",
    "Singleton",
    "Concurrency",
    "Throttle",
    "parse_duration",
    "Context",
    "Event",
    "Function",
    "InvokeError",
    "Ironflow",
    "IronflowAPIError",
    "IronflowError",
    "IronflowSync",
    "RunFailedError",
    "SyncClient",
    "NonRetryableError",
    "PullWorker",
    "RetryPolicy",
    "RunInfo",
    "SerializationError",
    "Step",
    "StepError",
    "StepOutputTooLargeError",
    "StepInfo",
    "StepTimeoutError",
    "StreamingWorker",
    "Trigger",
    "RegistrationRefusedError",
    "WorkerAuthError",
    "cron",
    "event",
    "function",
    "step_info",
]
