"""tpspec: tensor-parallel target models with speculative decoding.

Tokens are chosen from vocabulary-sharded logits without gathering them: each rank
reduces its slice to one 64-bit key per row and the ranks exchange keys.

The public names below are imported on first use, so ``import tpspec`` (and the
``tpspec`` command's ``--help`` / ``--version``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AllGatherKeyExchange": "tpspec.exchange",
    "CompletionOutput": "tpspec.runtime",
    "GREEDY_TEMPERATURE_THRESHOLD": "tpspec.keys",
    "KeyExchange": "tpspec.exchange",
    "LLM": "tpspec.runtime",
    "Logprob": "tpspec.sampling",
    "Mapping": "tpspec.mapping",
    "RequestOutput": "tpspec.runtime",
    "SamplingParams": "tpspec.sampling",
    "SpeculativeConfig": "tpspec.runtime",
    "StructuredOutputsParams": "tpspec.sampling",
    "VocabParallelHead": "tpspec.vocab_parallel",
    "VocabShardedLogits": "tpspec.vocab_parallel",
    "make_key_exchange": "tpspec.exchange",
    "pack_keys": "tpspec.keys",
    "unpack_keys": "tpspec.keys",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
