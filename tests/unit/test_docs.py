"""The README and docs/ stay valid: every link resolves and every code block reads.

- a relative link names a file of this repository, and a ``#fragment`` names
  a heading of the file it points at (GitHub's slugs);
- a ``python`` block parses (top-level ``await`` allowed: the blocks are
  fragments of an async function), a ``yaml`` block loads;
- in a ``sh`` block, every repository path (``scripts/…``, ``examples/…``,
  ``tests/…``) exists, every ``make TARGET`` is a Makefile target and every
  ``ironflow COMMAND`` is a command of the CLI.

The README stays a door: at most 300 lines.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```(\w*)\s*\n(.*?)^\s*```\s*$", re.S | re.M)
REPO_PATH = re.compile(r"(?<![\w./-])((?:scripts|examples|tests|docs|ironflow|actors)/[\w./-]+\.\w+)")
MAKE = re.compile(r"\bmake\s+([\w-]+)")
IRONFLOW_CMD = re.compile(r"(?:^|[\s;&|(])ironflow\s+([a-z][\w-]*)", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces → '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s):, mailto:
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def cli_commands() -> set[str]:
    from ironflow.cli import main

    return set(main.commands)


def code_block_problems(path: Path) -> list[str]:
    problems = []
    for lang, body in FENCE.findall(path.read_text()):
        body = textwrap.dedent(body)
        if lang == "python":
            try:
                compile(body, str(path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                        dont_inherit=True)
            except SyntaxError as exc:
                problems.append(f"python block does not parse: {exc}")
        elif lang == "yaml":
            try:
                yaml.safe_load(body)
            except yaml.YAMLError as exc:
                problems.append(f"yaml block does not load: {exc}")
        elif lang == "sh":
            for p in REPO_PATH.findall(body):
                if not (ROOT / p).exists():
                    problems.append(f"sh block names a missing file: {p}")
            for t in MAKE.findall(body):
                if t not in make_targets():
                    problems.append(f"sh block runs an unknown make target: {t}")
            for c in IRONFLOW_CMD.findall(body):
                if c not in cli_commands():
                    problems.append(f"sh block runs an unknown command: ironflow {c}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_link_of_the_docs_resolves(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_code_block_of_the_docs_reads(path: Path) -> None:
    assert code_block_problems(path) == []


def test_the_readme_is_a_door_not_a_manual() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_the_checks_fail_on_a_broken_link_a_bad_block_and_an_unknown_command(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n")
    bad = tmp_path / "bad.md"
    bad.write_text(
        "# Bad\n\n[gone](missing.md) [ok](other.md#a-heading) [no anchor](other.md#nope)"
        " [self](#bad)\n\n```python\ndef f(:\n```\n\n```yaml\na: [\n```\n\n"
        "```sh\nmake nosuchtarget\nironflow nosuchcommand\npython scripts/nope.py\n```\n"
    )
    assert broken_links(bad) == ["missing.md (no such file)", "other.md#nope (no such heading)"]
    problems = code_block_problems(bad)
    assert len(problems) == 5, problems
    assert slug("Isolation model (PostgreSQL, READ COMMITTED)") == "isolation-model-postgresql-read-committed"
