"""Runtime: the engine loop every rank runs, the launchers that start the ranks, and
``LLM``, the user's entry point (``tpspec.LLM``)."""

from .config import (CompletionOutput, EngineConfig, Request, RequestMetrics, RequestOutput, RequestStats,
                     SpeculativeConfig)
from .launchers import WorkerError
from .llm import LLM, EngineCounters, GenerateStats, tiny_model_path

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestMetrics",
    "EngineConfig",
    "EngineCounters",
    "GenerateStats",
    "Request",
    "RequestOutput",
    "RequestStats",
    "SpeculativeConfig",
    "WorkerError",
    "tiny_model_path",
]
