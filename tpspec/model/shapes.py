"""Real model shapes with random weights, built on each rank without a checkpoint.

``MODEL_SHAPES`` holds the ``config.json`` fields of a few public models (Llama 3 8B / 70B,
Qwen2.5 7B, and Llama 3.2 1B: a draft model with the Llama 3 vocabulary, ``DRAFT_SHAPES``).
:func:`random_model` builds this rank's shard of such a model directly on the device (only its
slices, never the whole model) and fills it with random values, so a benchmark sees the real
weight and KV-cache sizes in seconds, with no download.

A model path ``"shape:NAME"`` names such a model wherever the runtime accepts a checkpoint
directory; ``"shape:NAME,num_layers=2,vocab_size=4096"`` shrinks it for quick checks.

``"shape-eagle3:NAME[,draft_vocab_size=V]"`` names a random EAGLE-3 head for a target of shape
``NAME`` wherever the runtime accepts a head directory (:class:`~tpspec.model.eagle3.Eagle3Drafter`):
one decoder layer with the shape's hidden size, heads and MLP, drafting over ``V`` tokens (default
``min(32000, vocab // 2)`` of the target's vocabulary, spread evenly over it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..exchange.base import KeyExchange
from ..mapping import Mapping
from ..validation import check_int
from .config import ModelConfig
from .shape_table import DRAFT_SHAPES, MODEL_SHAPES  # noqa: F401 - DRAFT_SHAPES is public here too

SHAPE_PREFIX = "shape:"
EAGLE3_SHAPE_PREFIX = "shape-eagle3:"
DEFAULT_EAGLE3_DRAFT_VOCAB = 32000


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


def _parse_options(path: str, prefix: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, int]]:
    """``(NAME, {option: int})`` of ``PREFIX NAME[,option=N]...`` (``ValueError`` naming the spelling)."""
    name, *options = path[len(prefix):].split(",")
    sizes: dict[str, int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in allowed or not value.isdigit():
            spelling = "".join(f"[,{k}=N]" for k in allowed)
            raise ValueError(f"model path {path!r}: expected {prefix}NAME{spelling}")
        sizes[key] = int(value)
    return name, sizes


def config_from_path(path: str) -> ModelConfig:
    """The config a model path names: a ``shape:`` path or a checkpoint directory."""
    if is_shape_path(path):
        name, sizes = _parse_options(path, SHAPE_PREFIX, ("num_layers", "vocab_size"))
        return shape_config(name, **sizes)
    return ModelConfig.from_pretrained(path)


def eagle3_shape_path(name: str, draft_vocab_size: int | None = None) -> str:
    """The path naming a random EAGLE-3 head for target shape ``name`` (``ValueError`` when unknown)."""
    extra = "" if draft_vocab_size is None else f",draft_vocab_size={draft_vocab_size}"
    path = f"{EAGLE3_SHAPE_PREFIX}{name}{extra}"
    eagle3_shape_config(path)  # validates
    return path


def is_eagle3_shape_path(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(EAGLE3_SHAPE_PREFIX)


def eagle3_shape_config(path: str) -> tuple[dict[str, Any], int | None]:
    """``(config.json fields of the shape, draft_vocab_size or None)`` of a ``shape-eagle3:`` path
    (``ValueError`` for an unknown shape or a bad option). The fields are the target shape's; the
    head's own config (one layer, its draft vocabulary, the target's aux layers) is made from them
    by :meth:`~tpspec.model.eagle3.Eagle3Config.from_shape`."""
    name, options = _parse_options(path, EAGLE3_SHAPE_PREFIX, ("draft_vocab_size",))
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r} in {path!r} (known: {', '.join(MODEL_SHAPES)})")
    draft_vocab = options.get("draft_vocab_size")
    if draft_vocab is not None:
        check_int("draft_vocab_size", draft_vocab, low=1)
    return dict(MODEL_SHAPES[name]), draft_vocab


def spread_draft_ids(draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """``[draft_vocab_size]`` int64 strictly increasing target ids spread evenly over ``vocab_size``
    (``d2t = ids - arange``): the draft vocabulary of a random EAGLE-3 head, the same on every rank."""
    return torch.arange(draft_vocab_size, dtype=torch.int64) * vocab_size // draft_vocab_size


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
    fill_random(model, seed=seed)
    model.load_stats = None
    return model


@torch.no_grad()
def fill_random(module: Any, *, seed: int = 0) -> None:
    """Fill every parameter of ``module``'s ``shard_plan()`` (a model or an EAGLE-3 head) on its
    device: norms 1, the rest uniform with std 0.02, from this rank's own generator (``module.mapping``
    and ``module.device``)."""
    gen = torch.Generator(device=module.device).manual_seed(seed + 1000 * module.mapping.rank)
    for name, param, _ in module.shard_plan():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-0.0346, 0.0346, generator=gen)  # std 0.02, cheaper to draw than a normal
