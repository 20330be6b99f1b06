"""The ``config.json`` fields of the real model shapes that :mod:`tpspec.model.shapes` builds with
random weights (``MODEL_SHAPES``), and the draft-model shape of each target shape that has one
(``DRAFT_SHAPES``). Plain data, no torch: command lines list the shapes in their ``--help``.
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rope_theta": 500000.0,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "bos_token_id": 128000, "eos_token_id": 128001,
           "hidden_act": "silu", "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64),
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 32768, "hidden_act": "silu", "tie_word_embeddings": False,
                   "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151643,
                   "torch_dtype": "bfloat16"},
    # Llama 3.2 1B: the Llama 3 vocabulary, so it drafts for the Llama 3 shapes.
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}

# The draft-model shape for a target shape (its vocabulary); targets without one have none.
DRAFT_SHAPES: dict[str, str] = {"llama-3-8b": "llama-3.2-1b", "llama-3-70b": "llama-3.2-1b"}
