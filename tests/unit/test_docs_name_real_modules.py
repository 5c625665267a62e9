"""Every module, file or dotted name the docs and the code's comments mention
exists in the tree: a move or a rename that leaves a stale reference fails
here, naming the file and the line."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where the references are read: the docs, the README, and every Python file of ours.
SOURCES = [
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "README.md",
    *(p for top in ("ironflow", "actors", "tests", "scripts") for p in sorted((ROOT / top).rglob("*.py"))),
]
# A path into the tree: ``ironflow/store/waits.py``, ``docs/isolation.md``.
_PATH = re.compile(r"(?<![\w./-])((?:ironflow|actors|tests|scripts|docs)/[\w/.-]*\w\.(?:py|md|json))\b")
# A path inside ``ironflow/`` written without it, as the store's modules do: ``store/flow.py``.
_SHORT = re.compile(r"(?<![\w./-])((?:store|api|sdk|cli|protocol|engine)/\w+\.py)\b")
# A dotted name of ours: ``ironflow.store.base.Store``, ``actors.session``.
_DOTTED = re.compile(r"(?<![\w./-])((?:ironflow|actors)(?:\.\w+)+)")
# The same name in a Sphinx role or an import: a module reference for sure
# (``ironflow.worker`` alone may be a logger's or a span's name).
_ROLE = re.compile(r"(?::(?:mod|func|class|meth|data|attr|exc):`~?|\bfrom |\bimport )$")
# The repositories of others a doc names (``../shared/...``) are not ours to check.
_NOT_OURS = ("../", "shared/")
# Test modules whose stale references are their synthetic input.
_SYNTHETIC = (
    "tests/unit/test_docs_name_real_modules.py", "tests/unit/test_docs.py", "tests/unit/test_import_directions.py",
)


def _module_file(dotted: str) -> Path | None:
    base = ROOT / Path(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_problem(dotted: str, *, surely_a_module: bool = True) -> str | None:
    """Why ``dotted`` names nothing of the tree, or None: its longest module
    prefix must exist and the next part must be an attribute of it. Unless
    ``surely_a_module``, a name whose only module is the top package
    (``ironflow.worker``, a logger) is let pass."""
    parts = dotted.rstrip(".").split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if _module_file(prefix) is None:
            continue
        if n == len(parts):
            return None
        module = importlib.import_module(prefix)
        if hasattr(module, parts[n]) or parts[n] in {"py", "md"} or (n == 1 and not surely_a_module):
            return None
        return f"{prefix} has no {parts[n]!r}"
    return "no such module"


def stale_references(path: Path, text: str) -> list[str]:
    """``path:line: reference (why)`` for every reference in ``text`` that names nothing."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{path.relative_to(ROOT)}:{number}"
        for match in _PATH.finditer(line):
            ref = match.group(1)
            if not (ROOT / ref).exists() and not any(o in line[max(0, match.start() - 12):match.start()] for o in _NOT_OURS):
                found.append(f"{where}: {ref} (no such file)")
        for match in _SHORT.finditer(line):
            ref = match.group(1)
            if not (ROOT / "ironflow" / ref).exists():
                found.append(f"{where}: {ref} (no such file under ironflow/)")
        for match in _DOTTED.finditer(line):
            problem = dotted_problem(match.group(1), surely_a_module=bool(_ROLE.search(line[:match.start()])))
            if problem is not None:
                found.append(f"{where}: {match.group(1)} ({problem})")
    return found


def test_every_module_and_file_the_docs_and_comments_name_exists() -> None:
    stale = [
        s for path in SOURCES if str(path.relative_to(ROOT)) not in _SYNTHETIC
        for s in stale_references(path, path.read_text())
    ]
    assert not stale, "stale references:\n" + "\n".join(stale)


def test_the_check_catches_a_moved_module_a_missing_file_and_a_missing_name() -> None:
    text = (
        "See ironflow/metrics.py and store/nothing.py; ironflow.store.waits is fine,\n"
        "ironflow.store.base.Store too, but not ironflow.store.base.NoSuchThing\n"
        "nor :func:`ironflow.hypercorn_patch.apply`; docs/isolation.md exists,\n"
        "and ironflow.worker may be a logger's name.\n"
    )
    stale = stale_references(ROOT / "docs" / "example.md", text)
    assert stale == [
        "docs/example.md:1: ironflow/metrics.py (no such file)",
        "docs/example.md:1: store/nothing.py (no such file under ironflow/)",
        "docs/example.md:2: ironflow.store.base.NoSuchThing (ironflow.store.base has no 'NoSuchThing')",
        "docs/example.md:3: ironflow.hypercorn_patch.apply (ironflow has no 'hypercorn_patch')",
    ]
