"""``--set MODULE.NAME=VALUE``: a benchmark run with one of tpspec's tuning constants changed.

The kernels' launch constants (tiles, stages, split rules) and the dispatch switches live as
upper-case module constants, read when a kernel is launched or a rule is asked, never copied at
import. An A/B of one of them is then a benchmark command: ``tpspec bench step --set
tpspec.model.paged_attention_triton.PROGRAMS_PER_SM=1 ...`` beside the same command without it.

:func:`parse_overrides` checks each one in the calling process (a ``tpspec`` module that imports,
an upper-case constant it has, a Python literal of that constant's type);
:func:`apply_overrides` sets them, in every process that runs the benchmark's work (the rank
processes of ``tpspec bench step`` apply them first thing). Only what reads the constant at run
time sees the new value: a constant baked into an object built before (a model, an engine) is
not changed in it, which is why the ranks apply them before building anything.
"""

from __future__ import annotations

import ast
import importlib
from typing import Any, Sequence


def parse_overrides(items: Sequence[str] | None, *, option: str = "--set") -> dict[str, Any]:
    """``{"module.NAME": value}`` from ``MODULE.NAME=VALUE`` strings, in order; ``SystemExit``
    naming ``option`` for a malformed item, a module outside ``tpspec`` or that does not import, a
    name that is not an upper-case constant of it, or a value that is not a Python literal of the
    constant's type (an int where a float stands is accepted; a bool stands only for a bool)."""
    out: dict[str, Any] = {}
    for item in items or ():
        target, sep, text = item.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        if not sep or not module_name or not name:
            raise SystemExit(f"{option}: expected MODULE.NAME=VALUE, got {item!r}")
        if module_name != "tpspec" and not module_name.startswith("tpspec."):
            raise SystemExit(f"{option}: {module_name!r} is not a tpspec module")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SystemExit(f"{option}: module {module_name!r} does not import: {exc}") from None
        if not name.isupper() or not hasattr(module, name):
            raise SystemExit(f"{option}: {module_name} has no upper-case constant {name!r}")
        current = getattr(module, name)
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"{option}: {target}: {text!r} is not a Python literal") from None
        if not _same_kind(current, value):
            raise SystemExit(f"{option}: {target} is {type(current).__name__} ({current!r}); got "
                             f"{type(value).__name__} {value!r}")
        out[f"{module_name}.{name}"] = value
    return out


def _same_kind(current: Any, value: Any) -> bool:
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    if isinstance(current, tuple):
        return isinstance(value, tuple) and len(value) == len(current) and all(
            _same_kind(c, v) for c, v in zip(current, value))
    return type(current) is type(value)


def apply_overrides(overrides: dict[str, Any]) -> None:
    """Set every ``{"module.NAME": value}`` of :func:`parse_overrides` in this process."""
    for target, value in overrides.items():
        module_name, _, name = target.rpartition(".")
        setattr(importlib.import_module(module_name), name, value)


def add_set_argument(parser: Any) -> None:
    """The ``--set`` option of a benchmark (repeatable)."""
    parser.add_argument("--set", action="append", default=None, metavar="MODULE.NAME=VALUE",
                        help="run with a tpspec module constant changed, e.g. "
                             "tpspec.model.paged_attention_triton.PROGRAMS_PER_SM=1 (repeatable; recorded in the "
                             "JSON's meta)")
