"""``step.compensate``: the SDK's part of compensation (docs/compensation.md).

The engine decides when a run compensates (its final failure, or a cancel)
and says so with the ``compensate:begin`` step it writes; a segment whose
memo holds that step is a **compensation segment**. Its handler replays on
memoised results only, registering its undos again as it goes: a step that
completed returns its output, a step that failed raises its recorded error
(the ``except`` clauses take the path they took, and the step is not run
again), and the first step with no final record stops the replay
(:class:`StopReplay`). Then the undos not yet recorded run newest-first, each
as a durable step, a failing one recorded and passed over, and the segment
reports ``JobFailed`` with the original error, which ends the run.

In any other segment, ``step.compensate`` registers the undo and, the first
time in the run, records the ``compensate:registered`` step: how the engine
knows the run has undos.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ironflow.protocol import (
    COMPENSATE_PREFIX,
    MAX_STEP_NAME,
    CompensationBegin,
    ErrorInfo,
    MemoStep,
    compensation_step_id,
)
from ironflow.sdk.errors import (
    IronflowError,
    SerializationError,
    StepError,
    StepTimeoutError,
    WrongEventLoopError,
)

# Longest undo name: recorded as "compensate:<name>", a step name.
MAX_UNDO_NAME = MAX_STEP_NAME - len(COMPENSATE_PREFIX)

# Errors ``step.run`` raises as they are (not wrapped in StepError), by code:
# a replayed failure raises the same class the first run raised.
_RAISED_AS: dict[str, type[IronflowError]] = {
    cls.code: cls for cls in (StepTimeoutError, SerializationError, WrongEventLoopError)
}

_log = logging.getLogger("ironflow.sdk")


class StopReplay(BaseException):
    """A compensating replay reached a step with no final record: the handler
    stops there. A ``BaseException``, so ``except Exception`` in a handler
    never swallows it."""


class Undo:
    """One registered undo: its step id and name, and the call to make."""

    __slots__ = ("step_id", "name", "fn", "args", "limit")

    def __init__(
        self, step_id: str, name: str, fn: Callable[..., Any], args: tuple[Any, ...], limit: float | None
    ):
        self.step_id = step_id
        self.name = name
        self.fn = fn
        self.args = args
        self.limit = limit


def undo_name(name: Any) -> str:
    """The step name of the undo called ``name`` (``compensate:<name>``).

    Raises:
      ValueError: ``name`` is not a non-empty string of at most
        :data:`MAX_UNDO_NAME` characters.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("step.compensate needs a non-empty name, e.g. step.compensate('refund', refund, charge_id)")
    if len(name) > MAX_UNDO_NAME:
        raise ValueError(
            f"undo name {name[:40]!r}… is {len(name)} characters; at most {MAX_UNDO_NAME}"
            f" (it is recorded as {COMPENSATE_PREFIX!r} + name): use a shorter name"
        )
    return COMPENSATE_PREFIX + name


def replayed_error(memo: MemoStep, name: str) -> IronflowError:
    """What ``step.run`` raised when step ``name`` failed, rebuilt from its record."""
    info = memo.error
    if info is None:
        return StepError(f"step {name!r} failed", step_id=memo.step_id, name=name)
    cls = _RAISED_AS.get(info.code)
    if cls is not None:
        return cls(info.message)
    return StepError(
        f"step {name!r} failed: {info.message}",
        step_id=memo.step_id,
        name=name,
        code=None if info.retryable else info.code,
        retryable=info.retryable,
    )


class Compensation:
    """One segment's undos, in registration order, and — in a compensation
    segment — what began it (``begin``)."""

    __slots__ = ("undos", "begin", "registered", "_recorded", "_run_id")

    def __init__(self, run_id: str, memo: dict[str, MemoStep]):
        self.undos: list[Undo] = []
        self._run_id = run_id
        # Steps with a final record: an undo among them ran once already.
        self._recorded = frozenset(memo)
        began = memo.get(compensation_step_id(run_id, "begin"))
        self.begin: CompensationBegin | None = (
            None if began is None else msgspec.convert(began.output, CompensationBegin)
        )
        # Whether the engine knows (or is being told) that the run has undos.
        self.registered = compensation_step_id(run_id, "registered") in memo

    async def compensate(
        self, replay: Callable[[], Awaitable[Any]], execute: Callable[[Undo], Awaitable[Any]]
    ) -> ErrorInfo:
        """A compensation segment: ``replay`` the handler (its steps return their
        records, and it stops at the first without one), then run every undo
        not yet recorded, newest first, with ``execute`` (a durable step that
        reports the undo's result); a failing undo is recorded by ``execute``
        and passed over. Returns the error to report: the original, not
        retryable (the engine ends the run with it)."""
        assert self.begin is not None
        try:
            await replay()
        except StopReplay:
            pass
        except Exception as exc:  # the failure being compensated, replayed
            _log.debug("handler raised replaying to compensate", exc_info=exc,
                       extra={"fields": {"run_id": self._run_id}})
        for undo in reversed(self.undos):
            if undo.step_id in self._recorded:
                continue
            try:
                await execute(undo)
            except Exception as exc:
                _log.warning(
                    "undo %r failed (recorded; the other undos still run): %s", undo.name, exc,
                    extra={"fields": {"run_id": self._run_id, "step": undo.name}},
                )
        return msgspec.structs.replace(self.begin.error, retryable=False)
