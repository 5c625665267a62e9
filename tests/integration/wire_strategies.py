"""Hypothesis strategies that build JSON documents from the protocol types.

``document(T)`` walks ``msgspec.inspect.type_info(T)`` and produces builtins
(dicts, lists, numbers, strings) shaped like a ``T``. Every leaf leans on the
edges the node must survive: bounds and one past them, integers past 64 bits,
the wrong type, deep nesting, unknown keys, missing required fields, control
characters. ``mutated(doc)`` then damages an encoded document at the byte
level (truncation, a flipped byte, a spliced bracket run).
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

# Numbers the node must refuse or store faithfully.
EDGE_INTS = [0, -1, 1, 2**31, 2**53, 2**63 - 1, 2**63, 2**64, 10**23, -(2**63) - 1]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e308, -1e308, 1.5, 3.0e11]
# Strings a logger, a SQL driver or a path parser might trip on.
EDGE_STRINGS = ["", "x", "\n", "a\r\nb", "\x00", "\u2028", "'; DROP TABLE runs; --", "..", "é" * 300, "*", "a.*"]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def any_json(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Arbitrary JSON, including awkward leaves and (rarely) deep nesting."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(EDGE_INTS),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from(EDGE_STRINGS),
        st.text(max_size=20),
    )
    tree = st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )
    # Deep documents are built directly: recursion in the strategy would be slow.
    return st.one_of(tree, st.integers(min_value=90, max_value=110).map(_nested))


def _for(info: mi.Type) -> st.SearchStrategy[Any]:
    if isinstance(info, mi.StructType):
        return _struct(info)
    if isinstance(info, mi.UnionType):
        return st.one_of(*[_for(t) for t in info.types])
    if isinstance(info, mi.IntType):
        edges = [b for b in (info.ge, info.le, info.gt, info.lt) if b is not None]
        edges += [e + d for e in list(edges) for d in (-1, 1)]
        # Edges first: one_of draws its first branches more often when shrinking.
        return st.one_of(st.sampled_from(EDGE_INTS), st.sampled_from(edges or [1]), st.integers())
    if isinstance(info, mi.FloatType):
        edges = [float(b) for b in (info.ge, info.le, info.gt, info.lt) if b is not None]
        edges += [e * 1.0001 + 1 for e in edges]
        return st.one_of(
            st.sampled_from(edges or [1.0]),
            st.sampled_from(EDGE_FLOATS),
            st.floats(allow_nan=False, allow_infinity=False),
        )
    if isinstance(info, mi.StrType):
        lengths = [n for n in (info.min_length, info.max_length) if n is not None]
        sized = [("a" * max(n + d, 0)) for n in lengths for d in (-1, 0, 1)]
        return st.one_of(st.sampled_from(sized or ["a"]), st.sampled_from(EDGE_STRINGS), st.text(max_size=40))
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.one_of(st.sampled_from(list(info.values)), st.text(max_size=12))
    if isinstance(info, mi.ListType):
        return st.lists(_for(info.item_type), max_size=4)
    return any_json()


def _struct(info: mi.StructType) -> st.SearchStrategy[dict[str, Any]]:
    fields = {f.encode_name: _for(f.type) for f in info.fields}

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if info.tag_field is not None:
            doc[info.tag_field] = info.tag
        for f in info.fields:
            # Usually present; sometimes a required one goes missing.
            if draw(st.integers(0, 9)) < (9 if f.required else 6):
                doc[f.encode_name] = draw(fields[f.encode_name])
        if draw(st.integers(0, 19)) == 0:
            doc[draw(st.sampled_from(["surprise", "type", "__proto__"]))] = draw(any_json(3))
        if draw(st.integers(0, 19)) == 0 and doc:
            key = draw(st.sampled_from(sorted(doc)))
            doc[key] = draw(any_json(3))  # the wrong type in a known field
        return doc

    return build()


def document(kind: Any) -> st.SearchStrategy[Any]:
    """Documents shaped like ``kind`` (a protocol struct or a union of them)."""
    return _for(mi.type_info(kind))


def mutated(doc: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Encoded documents, some damaged at the byte level."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        raw = msgspec.json.encode(draw(doc))
        how = draw(st.integers(0, 9))
        if how == 0 and raw:
            return raw[: draw(st.integers(0, len(raw) - 1))]
        if how == 1 and raw:
            at = draw(st.integers(0, len(raw) - 1))
            return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
        if how == 2:
            at = draw(st.integers(0, len(raw)))
            return raw[:at] + b"[" * draw(st.integers(50, 2000)) + raw[at:]
        return raw

    return build()
