"""Real model shapes with random weights, built on each rank without a checkpoint.

``MODEL_SHAPES`` holds the ``config.json`` fields of a few public models (Llama 3 8B / 70B,
Qwen2.5 7B). :func:`random_model` builds this rank's shard of such a model directly on the
device (only its slices, never the whole model) and fills it with random values, so a
benchmark sees the real weight and KV-cache sizes in seconds, with no download.

A model path ``"shape:NAME"`` names such a model wherever the runtime accepts a checkpoint
directory; ``"shape:NAME,num_layers=2,vocab_size=4096"`` shrinks it for quick checks.
"""

from __future__ import annotations

from typing import Any

import torch

from ..exchange.base import KeyExchange
from ..mapping import Mapping
from ..validation import check_int
from .config import ModelConfig

SHAPE_PREFIX = "shape:"

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
}


def shape_path(name: str, num_layers: int | None = None, vocab_size: int | None = None) -> str:
    """The model path naming shape ``name`` (optionally with fewer layers or another vocabulary)."""
    shape_config(name, num_layers, vocab_size)  # validates
    extra = "".join(f",{k}={v}" for k, v in (("num_layers", num_layers), ("vocab_size", vocab_size))
                    if v is not None)
    return f"{SHAPE_PREFIX}{name}{extra}"


def is_shape_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(SHAPE_PREFIX)


def shape_config(name: str, num_layers: int | None = None, vocab_size: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of shape ``name`` (``ValueError`` naming the known ones)."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r} (known: {', '.join(MODEL_SHAPES)})")
    raw = dict(MODEL_SHAPES[name])
    for field, value in (("num_layers", num_layers), ("vocab_size", vocab_size)):
        if value is not None:
            check_int(field, value, low=1)
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        raw["vocab_size"] = vocab_size
    return ModelConfig.from_dict(raw)


def config_from_path(path: str) -> ModelConfig:
    """The config a model path names: a ``shape:`` path or a checkpoint directory."""
    if is_shape_path(path):
        name, *options = path[len(SHAPE_PREFIX):].split(",")
        sizes: dict[str, int] = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("num_layers", "vocab_size") or not value.isdigit():
                raise ValueError(f"model path {path!r}: expected shape:NAME[,num_layers=N][,vocab_size=V]")
            sizes[key] = int(value)
        return shape_config(name, **sizes)
    return ModelConfig.from_pretrained(path)


@torch.no_grad()
def random_model(config: ModelConfig, mapping: Mapping | None = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, exchange: KeyExchange | None = None,
                 attention_backend: str = "auto", seed: int = 0, deterministic: bool = False) -> Any:
    """This rank's shard of ``config`` with random weights (uniform, std 0.02; norms 1), made
    on ``device``. Collective like :func:`~tpspec.model.load_model` (it may build the key
    exchange). Every rank draws from its own generator: the values are not a sharded copy
    of one model, which does not matter for timing and keeps each rank's work to its shard."""
    from .llama import TPLlamaForCausalLM

    model = TPLlamaForCausalLM(config, mapping, device=device, dtype=dtype, exchange=exchange,
                               attention_backend=attention_backend, deterministic=deterministic)
    gen = torch.Generator(device=model.device).manual_seed(seed + 1000 * model.mapping.rank)
    for name, param, _ in model.shard_plan():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-0.0346, 0.0346, generator=gen)  # std 0.02, cheaper to draw than a normal
    model.load_stats = None
    return model
