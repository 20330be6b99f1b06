"""tpspec: tensor-parallel target models with speculative decoding.

Tokens are chosen from vocabulary-sharded logits without gathering them: each rank
reduces its slice to one 64-bit key per row and the ranks exchange keys.
"""

from .exchange import AllGatherKeyExchange, KeyExchange, make_key_exchange
from .keys import GREEDY_TEMPERATURE_THRESHOLD, pack_keys, unpack_keys
from .mapping import Mapping
from .runtime import LLM, CompletionOutput, RequestOutput, SpeculativeConfig
from .sampling import SamplingParams
from .vocab_parallel import VocabParallelHead, VocabShardedLogits

__version__ = "0.1.0"

__all__ = [
    "GREEDY_TEMPERATURE_THRESHOLD",
    "AllGatherKeyExchange",
    "CompletionOutput",
    "KeyExchange",
    "LLM",
    "Mapping",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "VocabParallelHead",
    "VocabShardedLogits",
    "make_key_exchange",
    "pack_keys",
    "unpack_keys",
]
