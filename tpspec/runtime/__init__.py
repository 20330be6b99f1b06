"""Runtime: the engine loop every rank runs, the launchers that start the ranks, and
``LLM``, the user's entry point (``tpspec.LLM``).

The names below are imported on first use: ``tpspec generate --help`` (whose module lives
here) does not import torch."""

from __future__ import annotations

from ..lazy import lazy_exports

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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
