"""The package's imports flow down the layers that docs/architecture.md lists: no cycle
between tpspec modules, and no import of a higher layer, not even one made at call time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in (root / "tpspec").rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """tpspec modules that ``name`` imports anywhere in its body (lazy imports too), except
    under ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == "tpspec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == "tpspec":
                module = node.module
            else:
                continue
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _layers() -> list[list[str]]:
    """From the doc: the layers, lowest first (each a list of paths; a path ending in "/" is a
    package)."""
    text = DOC.read_text()
    return [re.findall(r"`([^`]+)`", line) for line in re.findall(r"^\d+\. .*$", text, flags=re.M)]


def _path_of(module: str, modules: dict[str, Path]) -> str:
    return modules[module].relative_to(ROOT).as_posix()


def _layer_of(path: str, layers: list[list[str]]) -> int:
    matches = [(len(p), i) for i, paths in enumerate(layers) for p in paths
               if path == p or (p.endswith("/") and path.startswith(p))]
    assert matches, f"{path} is in no layer of docs/architecture.md"
    return max(matches)[1]  # the most specific entry


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def test_no_import_cycles():
    """No cycle, lazy imports included."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_flow_down_the_documented_layers():
    modules = _modules()
    layers = _layers()
    assert len(layers) >= 5, "docs/architecture.md lists no layers"
    upward = []
    for name, path in sorted(modules.items()):
        here = _path_of(name, modules)
        for dep in sorted(_imports(name, path, modules)):
            there = _path_of(dep, modules)
            if _layer_of(there, layers) > _layer_of(here, layers):
                upward.append(f"{here} imports {there}")
    assert not upward, "imports of a higher layer (docs/architecture.md):\n" + "\n".join(upward)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The parsing above finds a planted cycle (one side a lazy import) and the upward import."""
    pkg = tmp_path / "tpspec"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from ..high import thing\n")
    (pkg / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import other\n"
                                 "def f():\n    from .low import x\n")
    modules = _modules(tmp_path)
    assert _imports("tpspec.low", modules["tpspec.low"], modules) == {"tpspec.high"}
    assert _imports("tpspec.high", modules["tpspec.high"], modules) == {"tpspec.low"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _find_cycle(graph) == ["tpspec.high", "tpspec.low", "tpspec.high"]
    layers = [["tpspec/low/"], ["tpspec/high.py", "tpspec/__init__.py"]]
    assert _layer_of("tpspec/low/__init__.py", layers) == 0 and _layer_of("tpspec/high.py", layers) == 1


def test_public_names_load_on_first_use():
    """``tpspec``, ``tpspec.model`` and ``tpspec.runtime`` import no torch until a public name is
    read (``tpspec.lazy``); every name of their ``__all__`` then resolves, ``dir`` lists them and an
    unknown name raises ``AttributeError``."""
    import subprocess
    import sys

    code = ("import sys, tpspec, tpspec.model, tpspec.runtime\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "for pkg in (tpspec, tpspec.model, tpspec.runtime):\n"
            "    assert set(pkg.__all__) <= set(dir(pkg)) and not hasattr(pkg, 'no_such_name'), pkg.__name__\n"
            "    assert all(getattr(pkg, n) is not None and n in vars(pkg) for n in pkg.__all__), pkg.__name__\n"
            "assert tpspec.LLM is tpspec.runtime.LLM and 'torch' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
