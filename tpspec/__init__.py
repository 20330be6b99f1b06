"""tpspec: tensor-parallel target models with speculative decoding.

Tokens are chosen from vocabulary-sharded logits without gathering them: each rank
reduces its slice to one 64-bit key per row and the ranks exchange keys.

The public names below are imported on first use, so ``import tpspec`` (and the
``tpspec`` command's ``--help`` / ``--version``) does not pay for importing torch.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AllGatherKeyExchange": "exchange",
    "CompletionOutput": "runtime",
    "GREEDY_TEMPERATURE_THRESHOLD": "keys",
    "KeyExchange": "exchange",
    "LLM": "runtime",
    "Logprob": "sampling",
    "Mapping": "mapping",
    "RequestOutput": "runtime",
    "SamplingParams": "sampling",
    "SpeculativeConfig": "runtime",
    "StructuredOutputsParams": "sampling",
    "VocabParallelHead": "vocab_parallel",
    "VocabShardedLogits": "vocab_parallel",
    "make_key_exchange": "exchange",
    "pack_keys": "keys",
    "unpack_keys": "keys",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
