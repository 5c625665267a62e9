"""Bounds of every number, name and document on the wire.

Each limit says why it is what it is. The wire types (``worker``, ``http``)
use the ``Annotated`` aliases below, so a value out of range fails at the edge
with a ``msgspec.ValidationError`` naming the field; JSON nested too deep is
refused by :func:`check_json_depth` before it is decoded.
"""

from __future__ import annotations

import re
from typing import Annotated

from msgspec import Meta

# Hard ceiling for one websocket frame or HTTP JSON body. Large enough for a
# JobAssignment carrying a few hundred memoised steps, small enough that a
# runaway payload cannot balloon the node's memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024
# Deepest JSON nesting accepted in a frame or body. Decoders recurse per level
# and Python's recursion limit is 1,000 frames shared with the caller's stack;
# 100 levels leave a payload room for real documents and the node its stack.
MAX_JSON_DEPTH = 100

# ── bounds of every number and name on the wire ──────────────────────────────
# Integers are stored in 64-bit database columns; 2**53 - 1 also survives a
# round trip through JSON consumers that use doubles (JavaScript dashboards).
MAX_WIRE_INT = 2**53 - 1
# Epoch seconds: up to the year 5138 — far past any real deadline, far below
# what a float column or datetime conversion cannot represent.
MAX_EPOCH_S = 1e11
# One year: the longest delay, timeout or backoff cap a definition may ask for.
MAX_DURATION_S = 365 * 24 * 3600.0
# Hard ceilings of the types; the node's configurable limits (NodeConfig.limits)
# are lower by default and decide what one node actually accepts.
MAX_SLOTS_HARD = 100_000
MAX_FUNCTIONS_HARD = 100_000
MAX_TRIGGERS_HARD = 1_000

Seq = Annotated[int, Meta(ge=1, le=MAX_WIRE_INT)]
Epoch = Annotated[float, Meta(ge=0, le=MAX_EPOCH_S)]
DurationMs = Annotated[float, Meta(ge=0, le=MAX_DURATION_S * 1000)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]
Token = Annotated[str, Meta(min_length=1, max_length=256)]
ShortText = Annotated[str, Meta(max_length=1024)]
# Longest step name; its id (run id, escaped name, counter) fits in twice that plus change.
MAX_STEP_NAME = 512
StepName = Annotated[str, Meta(min_length=1, max_length=MAX_STEP_NAME)]
StepId = Annotated[str, Meta(min_length=1, max_length=4 * MAX_STEP_NAME)]


# A JSON string literal (escapes included): brackets inside one do not nest.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Keeps only brackets, with objects folded into arrays: only the depth matters.
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JsonTooDeep(ValueError):
    """A JSON document nests deeper than :data:`MAX_JSON_DEPTH`."""


def check_json_depth(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`JsonTooDeep` when ``data`` nests arrays/objects deeper than ``limit``.

    Runs before decoding, at C speed: a document with at most ``limit``
    brackets cannot be too deep (the common case, one ``count``); otherwise
    strings are cut out, everything but brackets is deleted, and each pass of
    ``replace("[]", "")`` peels exactly one level off the innermost pairs, so
    a document still non-empty after ``limit`` passes is deeper than that (or
    unbalanced, which is no valid JSON either).
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    # Without escapes, strings are exactly the odd pieces between quotes.
    unquoted = _JSON_STRING.sub(b"", raw) if b"\\" in raw else b"".join(raw.split(b'"')[::2])
    brackets = unquoted.translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    if b"[" * (limit + 1) in brackets:
        raise JsonTooDeep(f"JSON nests deeper than the limit of {limit} levels")
    for _ in range(limit):
        if not brackets:
            return
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break  # unbalanced: nothing left to peel
        brackets = shorter
    if brackets:
        raise JsonTooDeep(f"JSON nests deeper than the limit of {limit} levels (or is unbalanced)")
