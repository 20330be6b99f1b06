"""Runtime: the engine loop every rank runs, the launchers that start the ranks, and
``LLM``, the user's entry point (``tpspec.LLM``).

The names below are imported on first use: ``tpspec generate --help`` (whose module lives
here) does not import torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompletionOutput": "config",
    "EngineConfig": "config",
    "EngineCounters": "llm",
    "GenerateStats": "llm",
    "LLM": "llm",
    "Request": "config",
    "RequestMetrics": "config",
    "RequestOutput": "config",
    "RequestStats": "config",
    "SpeculativeConfig": "config",
    "WorkerError": "launchers",
    "tiny_model_path": "llm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
