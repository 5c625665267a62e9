"""Which way imports point (the layering rules of docs/design.md), checked on the source.

Every module of ``ironflow/`` and ``actors/`` is parsed and each import,
wherever it sits (module level, inside a function, under ``TYPE_CHECKING``),
is matched against the rules. Names match by prefix at a dot, so
``ironflow.api`` also covers a future ``ironflow.api.runs``.

A second graph, of the imports that run when a module is imported or one of
its functions is called, must have no cycle. It leaves out what never runs in
the imported module: ``TYPE_CHECKING`` blocks, and a program's entry point
(the ``if __name__ == "__main__":`` block and the module-level functions it
calls, such as ``ironflow.node.main``), which run only in a module named
``__main__``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("ironflow", "actors")


@dataclass(frozen=True)
class Rule:
    """Modules under ``source`` may not import ``forbidden``, or may import only ``allowed`` of ours."""

    why: str
    source: str
    forbidden: tuple[str, ...] = ()
    allowed: tuple[str, ...] | None = None
    # Importers exempt from the rule (a rule about who may import something).
    exempt: tuple[str, ...] = ()


RULES = [
    Rule(
        "a worker process loads no engine code",
        "ironflow.sdk",
        forbidden=("ironflow.store", "actors", "ironflow.api", "ironflow.node", "ironflow.cli",
                   "ironflow.engine"),
    ),
    Rule(
        "the engine's shared modules sit below the store, the actors and the API",
        "ironflow.engine",
        allowed=("ironflow.engine", "ironflow.protocol", "ironflow.config", "ironflow.ids"),
    ),
    Rule(
        "the store is below everything that uses it",
        "ironflow.store",
        forbidden=("actors", "ironflow.api", "ironflow.sdk", "ironflow.cli", "ironflow.node"),
    ),
    Rule(
        "an actor is testable without a server",
        "actors",
        forbidden=("ironflow.api", "ironflow.cli", "ironflow.sdk", "ironflow.node"),
    ),
    Rule(
        "wire types import nothing of ours but config and ids",
        "ironflow.protocol",
        allowed=("ironflow.protocol", "ironflow.config", "ironflow.ids"),
    ),
    Rule(
        "configuration imports nothing of ours but protocol and ids",
        "ironflow.config",
        allowed=("ironflow.protocol", "ironflow.config", "ironflow.ids"),
    ),
    Rule(
        "the CLI is a leaf: only the entry points start it",
        "",
        forbidden=("ironflow.cli",),
        # ``python -m ironflow`` and ``python -m ironflow.node`` (whose main()
        # is ``ironflow serve``, imported only when it runs as the program).
        exempt=("ironflow.cli", "ironflow.__main__", "ironflow.node"),
    ),
]

def under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for top in OURS
        for p in sorted((ROOT / top).rglob("*.py"))
        if ".venv" not in p.parts
    }


def _never_run_on_import(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) and ``if __name__ == "__main__":``."""
    if isinstance(test, ast.Name | ast.Attribute):
        return (test.id if isinstance(test, ast.Name) else test.attr) == "TYPE_CHECKING"
    return (
        isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
        and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _runtime_nodes(tree: ast.Module) -> Iterable[ast.AST]:
    """Every node of ``tree`` except the bodies of :func:`_never_run_on_import`
    blocks and of the module-level functions a ``__main__`` block calls."""
    entry_points = {
        call.func.id
        for top in tree.body
        if isinstance(top, ast.If) and _never_run_on_import(top.test)
        for call in ast.walk(top)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
    }
    todo: list[ast.AST] = [
        top for top in tree.body
        if not (isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef) and top.name in entry_points)
    ]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _never_run_on_import(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports_of(
    source: str, module: str, is_package: bool, known: Iterable[str], *, runtime_only: bool = False
) -> set[str]:
    """Our modules that ``source`` (the text of ``module``) imports.

    ``from pkg import name`` counts as ``pkg.name`` when that is one of the
    ``known`` modules, else as ``pkg``; relative imports are resolved.
    ``runtime_only`` leaves out the imports of ``TYPE_CHECKING`` and
    ``__main__`` blocks (function-level imports count).
    """
    known = set(known)
    found: set[str] = set()
    tree = ast.parse(source)
    for node in (_runtime_nodes(tree) if runtime_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known or any(
                    k.startswith(candidate + ".") for k in known
                ) else base)
    return {name for name in found if name.split(".")[0] in OURS}


def violations(
    graph: dict[str, set[str]], rules: list[Rule] = RULES
) -> set[tuple[str, str, str]]:
    """(importer, imported, why) for every import a rule forbids."""
    out = set()
    for importer, targets in graph.items():
        for rule in rules:
            if not under(importer, rule.source) or any(under(importer, e) for e in rule.exempt):
                continue
            for target in targets:
                if under(target, importer) and rule.source:
                    continue  # a package's own modules
                bad = any(under(target, f) for f in rule.forbidden)
                if rule.allowed is not None:
                    bad = bad or not any(under(target, a) for a in rule.allowed)
                if bad:
                    out.add((importer, target, rule.why))
    return out


def import_graph(*, runtime_only: bool = False) -> dict[str, set[str]]:
    modules = our_modules()
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", modules,
                         runtime_only=runtime_only)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of
    more than one module (or a module importing itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(root: str) -> None:
        # Tarjan's algorithm, iterative: (module, its successors not yet visited).
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1 or v in graph.get(v, ()):
                        found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_module_imports_against_the_allowed_directions() -> None:
    found = {f"{a} imports {b} ({why})" for a, b, why in violations(import_graph())}
    assert not found, "\n".join(sorted(found))


def test_no_module_imports_itself_back_through_others_function_level_imports_included() -> None:
    found = cycles(import_graph(runtime_only=True))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_deferred_circle_and_ignores_type_checking_and_main_blocks() -> None:
    known = {"ironflow.a", "ironflow.b", "ironflow.c", "ironflow.d"}
    sources = {
        # a -> b at module level, b -> a inside a function: a circle.
        "ironflow.a": "from ironflow import b\n",
        "ironflow.b": "def f():\n    from ironflow.a import x\n",
        # c -> d, and d -> c only for type checking or when run as a program.
        "ironflow.c": "import ironflow.d\n",
        "ironflow.d": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ironflow import c\n"
            "def main():\n    from ironflow.c import run\n"
            "if __name__ == '__main__':\n    import ironflow.c\n    main()\n"
        ),
    }
    graph = {
        name: imports_of(src, name, False, known, runtime_only=True) for name, src in sources.items()
    }
    assert cycles(graph) == [["ironflow.a", "ironflow.b"]]
    # Every import still counts for the direction rules.
    assert imports_of(sources["ironflow.d"], "ironflow.d", False, known) == {"ironflow.c"}


def test_the_checker_sees_every_module_and_its_imports() -> None:
    graph = import_graph()
    assert {"ironflow.sdk.streaming", "ironflow.store.base", "actors.waker", "ironflow.protocol"} <= set(graph)
    assert "ironflow.store" in graph["actors.waker"] and "actors.messages" in graph["actors.waker"]
    # A function-level import counts like any other.
    assert "ironflow.api" in graph["ironflow.node"] and "ironflow.node" in graph["ironflow.cli.serve"]


SYNTHETIC = {
    # An SDK module reaching the store, lazily and through `from ironflow import`.
    "ironflow.sdk.bad": "def f():\n    from ironflow import store\n",
    # A store module importing an actor by a relative import.
    "ironflow.store.bad": "from ...actors import waker\n",
    # An actor importing a module of a future API package.
    "actors.bad": "import ironflow.api.runs\n",
    # Wire types importing the store, and config the metrics (neither allowed).
    "ironflow.protocol.bad": "from ironflow.store.base import Fence\n",
    "ironflow.config": "from ironflow.engine import metrics\nfrom ironflow.ids import new_id\n",
    # Allowed: an actor importing the store, the SDK importing protocol.
    "actors.good": "from ironflow.store import Store\n",
    "ironflow.sdk.good": "from ironflow.protocol import Register\nfrom . import errors\n",
}


def test_the_checker_catches_a_forbidden_import_in_a_synthetic_module() -> None:
    known = set(our_modules()) | {"ironflow.api.runs"}
    graph = {
        name: imports_of(src, name, False, known) for name, src in SYNTHETIC.items()
    }
    assert graph["ironflow.store.bad"] == {"actors.waker"}
    assert graph["ironflow.sdk.good"] == {"ironflow.protocol", "ironflow.sdk.errors"}
    found = {(a, b) for a, b, _ in violations(graph)}
    assert found == {
        ("ironflow.sdk.bad", "ironflow.store"),
        ("ironflow.store.bad", "actors.waker"),
        ("actors.bad", "ironflow.api.runs"),
        ("ironflow.protocol.bad", "ironflow.store.base"),
        ("ironflow.config", "ironflow.engine.metrics"),
    }


def test_importing_the_sdk_loads_no_engine_module_or_database_driver() -> None:
    engine = ("ironflow.store", "actors", "ironflow.api", "ironflow.node", "ironflow.cli",
              "psycopg", "sqlite3", "quart", "hypercorn")
    tops = sorted({e.split(".")[0] for e in engine})
    code = (
        "import sys, ironflow, ironflow.sdk\n"
        "from ironflow import StreamingWorker, PullWorker, Ironflow\n"
        f"print(*(m for m in sys.modules if m.split('.')[0] in {tops!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    loaded = sorted(m for m in out if any(under(m, e) for e in engine))
    assert loaded == []
