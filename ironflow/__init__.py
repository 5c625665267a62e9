"""Ironflow in Python: durable functions made of memoised steps.

The public worker SDK is re-exported here lazily, so ``import
ironflow.protocol`` (the engine node does) loads neither the SDK's websocket
client nor httpx. The SDK runs under ``asyncio.run`` or ``trio.run``::

    import ironflow

    @ironflow.function(id="send-welcome", triggers=[ironflow.event("user.created")])
    async def send_welcome(ctx):
        return await ctx.step.run("send", send_email, ctx.event.data["email"])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    "NonRetryableError",
    "PullWorker",
    "RetryPolicy",
    "RunFailedError",
    "SerializationError",
    "StepError",
    "StepOutputTooLargeError",
    "StepInfo",
    "StepTimeoutError",
    "StreamingWorker",
    "SyncClient",
    "RegistrationRefusedError",
    "WorkerAuthError",
    "cron",
    "event",
    "function",
    "step_info",
]

if TYPE_CHECKING:
    from ironflow.sdk import (
        Batch,
        CancelOn,
        Concurrency,
        Context,
        Debounce,
        Event,
        Function,
        InvokeError,
        Ironflow,
        IronflowAPIError,
        IronflowError,
        IronflowSync,
        NonRetryableError,
        PullWorker,
        RateLimit,
        RegistrationRefusedError,
        RetryPolicy,
        RunFailedError,
        SerializationError,
        Singleton,
        StepError,
        StepInfo,
        StepOutputTooLargeError,
        StepTimeoutError,
        StreamingWorker,
        SyncClient,
        Throttle,
        WorkerAuthError,
        cron,
        event,
        function,
        parse_duration,
        step_info,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        import ironflow.sdk as sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'ironflow' has no attribute {name!r}")
