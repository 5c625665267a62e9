"""Ingest-side flow control, as a function definition declares it (docs/flow-control.md).

Each decides, when an event comes in, whether and when it starts a run of
the function: :class:`RateLimit` (events past the limit start none),
:class:`Debounce` (one run a quiet period after the last event),
:class:`Singleton` (one run per key in flight) and :class:`Batch` (one run
for up to ``max_size`` events). Durations are seconds on the wire; the SDK
(``ironflow/sdk/flow.py``) also takes a ``timedelta`` or ``"10m"``. A key is
an expression (``ironflow/expressions.py``: a dotted path or CEL), checked at
registration (``ironflow/flow_rules.py``).

:class:`FlowNote` is what the emit's answer and the event record say about a
function the event did not simply start.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ironflow.protocol.bounds import MAX_DURATION_S

# A key's expression text (the same bound as a concurrency key).
KeySource = Annotated[str, Meta(min_length=1, max_length=1024)]
# The shortest debounce: below a second the timer's slack (a dispatch round
# trip, the database clock's resolution) is no longer small against the period.
MIN_DEBOUNCE_S = 1.0
# The most events one batch run receives: all of them travel in its JobAssignment.
MAX_BATCH_SIZE = 1000


class RateLimit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """At most ``limit`` events per ``period_s`` (per ``key``) start a run; the
    others start none and are recorded as skipped (GCRA in the database)."""

    limit: Annotated[int, Meta(ge=1, le=1_000_000)]
    period_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)]
    key: KeySource | None = None


class Debounce(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One run ``period_s`` after the last event of its key, with that event's
    data; ``max_wait_s`` bounds the delay from the first event under a stream."""

    period_s: Annotated[float, Meta(ge=MIN_DEBOUNCE_S, le=MAX_DURATION_S)]
    key: KeySource | None = None
    max_wait_s: Annotated[float, Meta(ge=MIN_DEBOUNCE_S, le=MAX_DURATION_S)] | None = None


class Singleton(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """At most one run per key in flight (not ended, sleeping or waiting
    included): ``skip`` starts no new run, ``cancel`` cancels the running one."""

    key: KeySource | None = None
    mode: Literal["skip", "cancel"] = "skip"


class Batch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One run receives up to ``max_size`` events of its key (``ctx.events``),
    collected for at most ``timeout_s`` after the first."""

    max_size: Annotated[int, Meta(ge=1, le=MAX_BATCH_SIZE)] = 100
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)] = 5.0
    key: KeySource | None = None


FlowOutcome = Literal["skipped", "debounced", "batched", "cancelled"]
FlowMechanism = Literal["rate_limit", "debounce", "singleton", "batch", "concurrency"]


class FlowNote(msgspec.Struct, frozen=True, omit_defaults=True):
    """What flow control did with an event for one function.

    ``outcome``: ``skipped`` (no run: rate limit, singleton skip, a full
    concurrency key with ``on_limit="skip"``, a key that failed),
    ``debounced`` (``run_id`` starts at ``until`` unless a later event moves
    it), ``batched`` (joined ``run_id``'s batch, ``size`` events so far),
    ``cancelled`` (``run_id`` was cancelled for the new one: a singleton's
    ``cancel`` or a concurrency ``on_limit="cancel_in_progress"``). ``mechanism`` names which decided; ``reason`` is the human text.
    """

    function_id: str
    mechanism: FlowMechanism
    outcome: FlowOutcome
    reason: str
    run_id: str | None = None
    until: float | None = None
    size: int | None = None


class DebounceRecord(msgspec.Struct, frozen=True):
    """A pending debounce: ``run_id`` starts at ``fire_at`` (in ``fire_in_s``)
    with event ``event_id``, unless a later event of its key moves it."""

    function_id: str
    key: str
    run_id: str
    event_id: str
    first_at: float
    fire_at: float
    fire_in_s: float


class DebounceList(msgspec.Struct, frozen=True):
    """``GET /v1/debounces``."""

    debounces: list[DebounceRecord]
