"""Public names of a package imported on first use (PEP 562), so that importing the package,
and the ``tpspec`` commands that only parse arguments (``--help``), never import torch.

Torch-free: this module imports nothing but the standard library."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``).

    ``exports`` maps each public name to the submodule of ``package`` that defines it (``"llm"``
    for ``package.llm``); ``namespace`` is the package's ``globals()``, where a name is kept once
    imported. Use::

        __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

    An unknown name raises ``AttributeError`` as a module attribute does."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
