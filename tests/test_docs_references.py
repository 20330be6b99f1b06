"""Every test the README and docs name exists and can fail; every repository path they name exists.

The guarantees table (README, "Guarantees and their tests") and the docs back each promise with
named tests: ``tests/test_x.py``, ``tests/test_x.py::test_name`` or, later in the same paragraph
or table row, ``::test_name`` (of the file last named before it), or a test's name alone in
backticks (of any test file). Each named file must exist, each named test must be a function of
its file, and its body must hold more than a docstring.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_REF = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?|(?<![\w/.])::(\w+)")
_NAME_ALONE = re.compile(r"`(test_\w+)(?:\[[^\]`]*\])?`")
_PATH = re.compile(r"`((?:tpspec|launch|tests|docs|examples|csrc|\.ci)/[\w./-]+)`")


def named_tests(text: str) -> list[tuple[int, str, str | None]]:
    """``(line number, test file, test function or None)`` for each reference in ``text``; a
    bare ``::name`` belongs to the last file named before it in its paragraph or table row (none:
    file ``""``)."""
    refs = []
    current = ""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("|"):
            current = ""  # a new paragraph or table row
        for match in _REF.finditer(line):
            path, name, bare = match.groups()
            if path is not None:
                current = path
                refs.append((number, path, name))
            else:
                refs.append((number, current, bare))
    return refs


@functools.lru_cache(maxsize=None)
def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    """The functions of a Python file by name (each file parsed once)."""
    tree = ast.parse(path.read_text())
    found: dict[str, ast.FunctionDef] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            found.setdefault(node.name, node)
    return found


@functools.lru_cache(maxsize=None)
def _every_test_function() -> dict[str, ast.FunctionDef]:
    every: dict[str, ast.FunctionDef] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        every.update(_functions(path))
    return every


def _only_a_docstring(fn: ast.FunctionDef) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return all(isinstance(node, ast.Pass) for node in body)


def test_the_parser_binds_bare_names_to_the_last_file_of_their_paragraph_or_row():
    text = ("a `tests/test_a.py::test_x`, `::test_y`; `tests/test_b.py`,\n`::test_z[p]`\n\n`::test_w` alone\n"
            "| `tests/test_c.py` |\n| `::test_v` |")
    assert named_tests(text) == [(1, "tests/test_a.py", "test_x"), (1, "tests/test_a.py", "test_y"),
                                 (1, "tests/test_b.py", None), (2, "tests/test_b.py", "test_z"), (4, "", "test_w"),
                                 (5, "tests/test_c.py", None), (6, "", "test_v")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_test_exists_and_can_fail(doc):
    problems = []
    for number, path, name in named_tests(doc.read_text()):
        where = f"{doc.name}:{number}"
        if not path:
            problems.append(f"{where}: ::{name} follows no test file on its line")
            continue
        if not (ROOT / path).is_file():
            problems.append(f"{where}: {path} does not exist")
            continue
        if name is None:
            continue
        fn = _functions(ROOT / path).get(name)
        if fn is None:
            problems.append(f"{where}: {path} has no function {name}")
        elif _only_a_docstring(fn):
            problems.append(f"{where}: {path}::{name} has no body: it cannot fail")
    every = _every_test_function()
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for name in _NAME_ALONE.findall(line):
            if name not in every:
                problems.append(f"{doc.name}:{number}: no test file has a function {name}")
            elif _only_a_docstring(every[name]):
                problems.append(f"{doc.name}:{number}: {name} has no body: it cannot fail")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_repository_path_named_exists(doc):
    missing = [f"{doc.name}:{number}: {path}" for number, line in enumerate(doc.read_text().splitlines(), 1)
               for path in _PATH.findall(line) if not (ROOT / path).exists()]
    assert not missing, "\n".join(missing)
