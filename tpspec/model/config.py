"""The model's shape and numerics, read from a Hugging Face ``config.json``.

Only what the Llama-family decoder of :mod:`tpspec.model.llama` can run is accepted;
anything else fails here with a ``ValueError`` naming the field, before a weight is read.
Both spellings of rotary settings are understood: ``rope_theta`` + ``rope_scaling``
(transformers 4.x) and ``rope_parameters`` (transformers 5.x).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..validation import check_int

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_json(path: str) -> Any:
    """The JSON file at ``path``; a ``ValueError`` naming the file when it is not valid JSON."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family causal LM (all sizes are the full, unsharded ones).

    ``rope_scaling`` is ``None`` or a dict with ``rope_type`` in ``default``/``linear``/``llama3``
    plus that type's parameters. ``eos_token_id`` is an int, a list of ints, or ``None``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check_int(f"config field {name}", value, low=1)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``<path>/config.json`` (and ``generation_config.json`` for a missing ``eos_token_id``).

        Raises ``FileNotFoundError`` without a config and ``ValueError`` naming the first
        unsupported field (architecture, activation, rotary type, sliding window, ...).
        """
        path = os.fspath(path)
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"no config.json in {path!r}: not a Hugging Face model directory")
        raw = read_json(config_file)
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file} holds a JSON {type(raw).__name__}, not an object")
        if raw.get("eos_token_id") is None:
            gen_file = os.path.join(path, "generation_config.json")
            if os.path.isfile(gen_file):
                gen = read_json(gen_file)
                if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
                    raw = dict(raw, eos_token_id=gen["eos_token_id"])
        try:
            return cls.from_dict(raw)
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed ``config.json`` dict (see :meth:`from_pretrained`)."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "mistral": "MistralForCausalLM"}.get(raw.get("model_type"))
        if len(archs) > 1 or arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu' / SwiGLU)")
        if raw.get("use_sliding_window") or _sliding_window_active(raw):
            raise ValueError(
                f"unsupported sliding_window={raw.get('sliding_window')!r}: only full attention is implemented"
            )
        if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor={raw['partial_rotary_factor']!r}")
        if int(raw.get("pretraining_tp", 1)) != 1:
            raise ValueError(f"unsupported pretraining_tp={raw['pretraining_tp']!r}")
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
            if name not in raw:
                raise ValueError(f"config field {name!r} is missing")

        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope_settings(raw)
        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False  # Qwen2 always has q/k/v biases, never an o_proj bias
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            extra=dict(raw),
        )

    # ------------------------------------------------------------------ helpers
    @property
    def eos_token_ids(self) -> list[int]:
        """``eos_token_id`` as a (possibly empty) list."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)


def _sliding_window_active(raw: dict[str, Any]) -> bool:
    """A sliding window matters only when it is shorter than the context the model takes."""
    if raw.get("model_type") == "qwen2" or "use_sliding_window" in raw:
        return bool(raw.get("use_sliding_window", False))
    window = raw.get("sliding_window")
    return window is not None and window < raw.get("max_position_embeddings", 2048)


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling or None)`` from either transformers spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = dict(scaling, rope_type=rope_type)
        scaling.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            scaling = None
        else:
            required = {"linear": ("factor",),
                        "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings")}[rope_type]
            for key in required:
                if key not in scaling:
                    raise ValueError(f"rope_scaling type {rope_type!r} needs {key!r}")
    return theta, scaling
