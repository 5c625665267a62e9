"""Trigger filters and expression keys at ingest (docs/triggers.md).

A function an event triggers (the trigger index, ``core.trigger_patterns``)
starts a run only when one of its triggers covering the event's name has no
filter or a true one, and its concurrency key can be computed
(ironflow/definitions.py ``start_verdict``). The rest are recorded on the
event, in the same INSERT that writes it (``events.notes``: NULL when nothing
was filtered, so an emit pays no statement for this), and read back by
``GET /v1/events/{id}`` (``EventRecord.filtered``).

A definition's expressions are compiled once per stored definition version:
the store decodes each stored definition text once (``SqlStoreBase._fdef``)
and compiles each decoded definition once (:class:`CompiledDefinitions`, one
per store: ``SqlStoreBase.definitions``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ironflow.definitions import (
    CompiledDefinition,
    EventBinding,
    compile_definition,
    failure_code,
    start_verdict,
    triggers_name,
)
from ironflow.expressions import EvaluationError
from ironflow.protocol import FilterNote, FunctionDef, concurrency_keyed
from ironflow.store.base import KeyEvaluationFailed

# Most compiled definitions kept (one per function id; a new version replaces
# its function's entry): past it the cache starts over.
_COMPILED_MAX = 4096

_notes_encode = msgspec.json.Encoder().encode


def notes_text(filtered: list[FilterNote], cancelled: list[str]) -> str | None:
    """``events.notes`` for an event: None when it filtered and cancelled nothing."""
    if not filtered and not cancelled:
        return None
    body: dict[str, Any] = {}
    if filtered:
        body["filtered"] = filtered
    if cancelled:
        body["cancelled_run_ids"] = cancelled
    return _notes_encode(body).decode()


class EventNotes(msgspec.Struct, frozen=True):
    """What ``events.notes`` holds (see :func:`notes_text`)."""

    filtered: list[FilterNote] = []
    cancelled_run_ids: list[str] = []


notes_decode = msgspec.json.Decoder(EventNotes).decode


class CompiledDefinitions:
    """Compiled definitions, start verdicts and run keys (module docstring):
    a store's cache of compilations, called on the Trio thread or in its
    transactions' work alike (a dict read and write, no await between)."""

    def __init__(self) -> None:
        # function id → (the decoded definition it was compiled from, its compilation).
        self._by_function: dict[str, tuple[FunctionDef, CompiledDefinition]] = {}

    def compiled(self, fd: FunctionDef) -> CompiledDefinition | None:
        """``fd`` compiled, once per decoded definition; None if it no longer
        compiles (stored by a version with other rules: it starts nothing)."""
        cache = self._by_function
        entry = cache.get(fd.id)
        if entry is not None and entry[0] is fd:
            return entry[1]
        try:
            compiled = compile_definition(fd)
        except ValueError:
            return None
        if len(cache) >= _COMPILED_MAX:
            cache.clear()
        cache[fd.id] = (fd, compiled)
        return compiled

    def judge(
        self, fds: list[FunctionDef], event_id: str, name: str, data: Any
    ) -> tuple[list[FunctionDef], list[FilterNote]]:
        """The functions event ``name`` starts a run of, and a note for each it
        triggers but does not start (filter false, filter or key failed)."""
        starting: list[FunctionDef] = []
        notes: list[FilterNote] = []
        binding = EventBinding(name, data, event_id)  # converted once for all the filters
        for fd in fds:
            compiled = self.compiled(fd)
            if compiled is None:
                notes.append(FilterNote(fd.id, "its stored definition no longer compiles", True))
                continue
            if compiled.has_filters:
                starts, reason, code = start_verdict(compiled, name, data, event_id, binding)
                if not starts:
                    if reason != "no trigger covers this event":
                        notes.append(FilterNote(fd.id, reason or "filtered", code is not None, code))
                    continue
            elif not any(triggers_name(t.event, name) for t in fd.triggers):
                continue
            if compiled.key is not None and not compiled.key.is_path:
                try:
                    compiled.concurrency_key(name, data, event_id)
                except EvaluationError as exc:
                    notes.append(FilterNote(fd.id, str(exc), True, failure_code(exc)))
                    continue
            starting.append(fd)
        return starting, notes

    def run_key(self, fd: FunctionDef, name: str, data: Any, event_id: str) -> str | None:
        """The concurrency key of a new run of ``fd`` for this event (its
        path or its expression: a run's ``concurrency_key``).

        Raises:
          KeyEvaluationFailed: its key expression failed on this event.
        """
        keyed = concurrency_keyed(fd)  # the one keyed constraint (layered limits)
        if keyed is None or keyed.key is None:
            return None
        compiled = self.compiled(fd)
        if compiled is None:
            return None
        try:
            return compiled.concurrency_key(name, data, event_id)
        except EvaluationError as exc:
            raise KeyEvaluationFailed(f"function {fd.id}: {exc}") from None

