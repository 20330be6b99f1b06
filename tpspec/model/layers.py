"""Tensor-parallel building blocks of the Llama-family decoder.

Each layer holds only this rank's slice of its weights and records, in ``self.plan``,
which slice of which checkpoint tensor fills each parameter (:class:`ShardSpec`); the
loader reads exactly those slices. Sharding follows Megatron: column-parallel
linears split their outputs (no communication), row-parallel linears split their
inputs and sum the partial outputs over the TP group.

``deterministic=True`` (every layer's keyword) computes the same functions with the fixed
reduction orders of :mod:`tpspec.model.deterministic`: per-row results independent of the
batch and bit-identical at every power-of-two TP size. The default path is untouched.

``fused=True`` (RMSNorm, Attention, MLP; the model passes :func:`use_fused_kernels`'s decision)
runs the elementwise work of a layer in the Triton kernels of :mod:`tpspec.model.fused_triton`:
the norm with its residual add, rotary with the KV write, ``silu(gate) * up``.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..vocab_parallel import vocab_shard_bounds
from . import deterministic as det
from .attention import AttendFn
from .batch import AttentionMetadata
from .comm import all_reduce_sum
from .config import ModelConfig
from .kv_cache import KVPages
from .linear import (gemv_kernels, linear, use_triton_linear_silu_mul, use_triton_norm_linear,
                     use_triton_silu_linear)

# Whether models on CUDA run the fused Triton kernels of :mod:`tpspec.model.fused_triton`: on, since a
# GPU run of tests/test_fused_triton.py's ``gpu`` tests passed (only such a checked path may stand on).
FUSED_CUDA_KERNELS = True
# The CPU tests' switch: models on CPU run the same kernels under Triton's interpreter (TRITON_INTERPRET=1).
FUSED_UNDER_INTERPRETER = False
# Whether fused models compute the rotary cos and sin in one kernel (fused_triton.rotary_cos_sin) rather than
# torch's chain of seven elementwise launches: the same bits on CUDA (tests/test_fused_triton.py's GPU test).
ROTARY_KERNEL = True
# Whether fused models look up their token embedding in one kernel (fused_triton.embed) rather than nine torch
# launches (the range mask, the lookup, the product with the mask): the same rows on CUDA (tests/test_fused_triton.py's
# GPU test).
EMBED_KERNEL = True


@functools.lru_cache(maxsize=None)
def fused_kernels() -> Any:
    """:mod:`tpspec.model.fused_triton`, or None where ``triton`` does not import."""
    try:
        return importlib.import_module(f"{__package__}.fused_triton")
    except ImportError:
        return None


def use_fused_kernels(device: torch.device | str, *, deterministic: bool = False) -> bool:
    """Whether a model on ``device`` runs the fused kernels: never in deterministic mode (its
    fixed-order path stays as it is) or without ``triton``; on CUDA when ``FUSED_CUDA_KERNELS`` is on
    and ``triton`` compiles (not its interpreter); on CPU only under Triton's interpreter
    (``TRITON_INTERPRET=1``) with ``FUSED_UNDER_INTERPRETER`` on, how the CPU tests run them. Every
    rank of a model decides alike."""
    if deterministic:
        return False
    kernels = fused_kernels()
    if kernels is None:
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return FUSED_CUDA_KERNELS and not kernels.INTERPRETED
    return kind == "cpu" and kernels.INTERPRETED and FUSED_UNDER_INTERPRETER


@dataclass(frozen=True)
class ShardSpec:
    """Fill ``param[dest_start : dest_start + length]`` along ``dim`` with
    ``checkpoint[name][start : start + length]`` along ``dim`` (``dim=None``: the whole
    tensor). ``full_shape`` is the shape the checkpoint tensor must have."""

    name: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0
    dest_start: int = 0


def shard_plan(model: nn.Module) -> list[tuple[str, nn.Parameter, list[ShardSpec]]]:
    """Every parameter of ``model`` that a submodule's ``plan`` (parameter name -> its
    :class:`ShardSpec` list) names, with those slices: ``(qualified name, param, specs)``."""
    out = []
    for mod_name, module in model.named_modules():
        for pname, specs in getattr(module, "plan", {}).items():
            out.append((f"{mod_name}.{pname}" if mod_name else pname, getattr(module, pname), specs))
    return out


@dataclass(frozen=True)
class HeadSplit:
    """Which attention heads one rank holds: query heads ``[q_start, q_start + q_heads)``,
    KV heads ``[kv_start, kv_start + kv_heads)`` (a KV head may be held by several ranks)."""

    q_heads: int
    q_start: int
    kv_heads: int
    kv_start: int


def split_heads(cfg: ModelConfig, tp_size: int, tp_rank: int) -> HeadSplit:
    """Split the attention heads over ``tp_size`` ranks; raises ``ValueError`` when they don't split.

    Query heads must divide evenly. KV heads divide evenly when there are at least
    ``tp_size`` of them; with fewer, ``tp_size`` must be a multiple of their count and
    each KV head is replicated on ``tp_size / num_kv_heads`` consecutive ranks.
    """
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    if nh % tp_size != 0:
        raise ValueError(f"num_attention_heads={nh} cannot be split over tp_size={tp_size} ranks")
    q_heads = nh // tp_size
    if nkv >= tp_size:
        if nkv % tp_size != 0:
            raise ValueError(f"num_key_value_heads={nkv} cannot be split over tp_size={tp_size} ranks")
        kv_heads = nkv // tp_size
        kv_start = tp_rank * kv_heads
    else:
        if tp_size % nkv != 0:
            raise ValueError(
                f"num_key_value_heads={nkv} cannot be replicated over tp_size={tp_size} ranks "
                f"(tp_size must be a multiple of it)"
            )
        kv_heads = 1
        kv_start = tp_rank // (tp_size // nkv)
    return HeadSplit(q_heads, tp_rank * q_heads, kv_heads, kv_start)


def split_evenly(name: str, size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(start, length)`` of this rank's equal share of ``size``; ``ValueError`` when it doesn't divide."""
    if size % tp_size != 0:
        raise ValueError(f"{name}={size} cannot be split over tp_size={tp_size} ranks")
    length = size // tp_size
    return tp_rank * length, length


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back (as transformers does).

    ``forward(x)``: the norm of ``x``; ``add_forward(x, residual)``: ``(norm(h), h)`` with
    ``h = residual + x`` (one kernel when ``fused``); ``residual_forward(x, residual)``: the same,
    or ``(norm(x), x)`` when ``residual`` is None."""

    def __init__(self, name: str, hidden_size: int, eps: float, *, dtype: torch.dtype, device: Any,
                 deterministic: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.deterministic = deterministic
        self.fused = fused and not deterministic
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.plan = {"weight": [ShardSpec(name, (hidden_size,))]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            return det.rms_norm(x, self.weight, self.eps)
        if self.fused:
            return fused_kernels().rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            return fused_kernels().add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h

    def residual_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self(x), x
        return self.add_forward(x, residual)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with ``default``, ``linear`` or ``llama3`` frequency scaling.

    ``forward(positions [N]) -> (cos, sin)``, each ``[N, head_dim]`` in ``dtype``; the
    angles are computed in float32 from the positions on the fly (no table to outgrow). ``fused``
    (with :data:`ROTARY_KERNEL`): in one kernel, :func:`~tpspec.model.fused_triton.rotary_cos_sin`.
    """

    def __init__(self, cfg: ModelConfig, *, device: Any, deterministic: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.fused = fused and not deterministic
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
        scaling = cfg.rope_scaling
        if scaling is not None and scaling["rope_type"] == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif scaling is not None and scaling["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.deterministic:
            return det.rotary_cos_sin(positions, self.inv_freq, dtype)
        if self.fused and ROTARY_KERNEL:
            return fused_kernels().rotary_cos_sin(positions, self.inv_freq, dtype)
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, short ones kept,
    a linear blend (in 1/wavelength) between ``low_freq_factor`` and ``high_freq_factor``."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    blend = (old_len / wavelen - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, out)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, head_dim]`` by the per-token angles (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary like :class:`~tpspec.VocabParallelHead`:
    each rank looks up the ids of its slice, zeros the others, and the TP group sums.
    Ids outside ``[0, vocab_size)`` embed to zeros (never an indexing crash). ``fused`` (with
    :data:`EMBED_KERNEL`): a rank's lookup in one kernel, :func:`~tpspec.model.fused_triton.embed`."""

    def __init__(self, name: str, vocab_size: int, hidden_size: int, tp_size: int, tp_rank: int, group: Any,
                 *, dtype: torch.dtype, device: Any, deterministic: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.fused = fused and not deterministic
        self.offset, width, self.real_width = vocab_shard_bounds(vocab_size, tp_size, tp_rank)
        self.tp_size = tp_size
        self.group = group
        self.weight = nn.Parameter(torch.zeros(width, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.plan = {"weight": [ShardSpec(name, (vocab_size, hidden_size), 0, self.offset, self.real_width)]}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._local_rows(ids)
        if self.tp_size > 1:
            all_reduce_sum(out, self.group)
        # Deterministic: one rank holds the value, the others +0, so the sum is that value in any
        # order; + 0.0 turns a -0.0 into +0.0 at every TP size alike (TP=1 included).
        return out + 0.0 if self.deterministic else out

    def _local_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows for ``ids``: its slice's rows, zeros for ids outside it."""
        if self.fused and EMBED_KERNEL:
            return fused_kernels().embed(ids, self.weight, self.offset, self.real_width)
        local = ids - self.offset
        valid = (local >= 0) & (local < self.real_width)
        out = F.embedding(torch.where(valid, local, torch.zeros_like(local)), self.weight)
        if self.deterministic:
            return torch.where(valid[:, None], out, torch.zeros_like(out))
        return out * valid[:, None].to(out.dtype)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with this rank's output rows of one or more checkpoint linears,
    concatenated (fused q/k/v or gate/up). ``pieces``: ``(checkpoint prefix, full out
    features, start, length)``; the output is the pieces in order. No communication."""

    def __init__(self, in_features: int, pieces: list[tuple[str, int, int, int]], bias: bool,
                 *, dtype: torch.dtype, device: Any, deterministic: bool = False) -> None:
        super().__init__()
        self.fixed_order = det.FixedOrderMatmul(det.Contraction.of(in_features), 1) if deterministic else None
        self.out_sizes = [length for _, _, _, length in pieces]
        out = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.zeros(out, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.plan: dict[str, list[ShardSpec]] = {"weight": [], "bias": []}
        dest = 0
        for prefix, full_out, start, length in pieces:
            self.plan["weight"].append(ShardSpec(f"{prefix}.weight", (full_out, in_features), 0, start, length, dest))
            if bias:
                self.plan["bias"].append(ShardSpec(f"{prefix}.bias", (full_out,), 0, start, length, dest))
            dest += length
        if not bias:
            del self.plan["bias"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_order is not None:
            y = self.fixed_order.rounded(x, self.weight)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias)

    def norm_forward(self, norm: RMSNorm, x: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(h)), h)`` with ``h = x + residual`` (``x`` when ``residual`` is None): one
        kernel where :meth:`takes_norm` says so (a one-row step), else ``norm``'s own path, then
        :meth:`forward`."""
        if self.takes_norm(norm, x, residual):
            return gemv_kernels().norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        normed, h = norm.residual_forward(x, residual)
        return self(normed), h

    def takes_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether :meth:`norm_forward` runs the norm inside this linear's GEMV
        (:func:`~tpspec.model.linear.use_triton_norm_linear`)."""
        return (self.fixed_order is None and not norm.deterministic
                and use_triton_norm_linear(x, residual, norm.weight, self.weight, self.bias))


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_r W_r^T) + b``: this rank holds input columns
    ``[start, start + length)`` of checkpoint linear ``prefix``. By default the partial
    outputs are summed over ``group``; ``forward(x, reduce=fn)`` replaces that sum (attention
    DP reduce-scatters instead). The bias is added once, after the reduction.

    ``deterministic``: each rank sums its segments of the contraction's fixed tree, the ranks
    all-gather those float32 partials and sum them by the tree's top (no all-reduce); needs a
    power-of-two ``tp_size`` whose split of ``full_in`` follows the tree (``ValueError``)."""

    def __init__(self, prefix: str, full_in: int, out_features: int, start: int, length: int, bias: bool,
                 group: Any, tp_size: int, *, dtype: torch.dtype, device: Any, deterministic: bool = False) -> None:
        super().__init__()
        self.fixed_order = None
        if deterministic:
            det.check_contraction_split(f"{prefix} input features", full_in, tp_size)
            self.fixed_order = det.FixedOrderMatmul(det.Contraction.of(full_in), tp_size)
        self.group = group
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.zeros(out_features, length, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.plan = {"weight": [ShardSpec(f"{prefix}.weight", (out_features, full_in), 1, start, length)]}
        if bias:
            self.plan["bias"] = [ShardSpec(f"{prefix}.bias", (out_features,))]

    def forward(self, x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        if self.fixed_order is not None:
            if reduce is not None:
                raise ValueError("deterministic mode does not support attention DP")
            y = self.fixed_order.rounded(x, self.weight, self.group)
            return y if self.bias is None else y + self.bias
        return self._sum_ranks(linear(x, self.weight), reduce)

    def silu_mul_forward(self, gate_up: torch.Tensor,
                         reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``self(silu(gate) * up, reduce)`` for ``gate_up = cat(gate, up)`` as one kernel, where
        :func:`~tpspec.model.linear.use_triton_silu_linear` takes it (the caller asks first)."""
        return self._sum_ranks(gemv_kernels().silu_mul_linear(gate_up, self.weight), reduce)

    def _sum_ranks(self, y: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        if reduce is not None:
            y = reduce(y)
        elif self.tp_size > 1:
            y = all_reduce_sum(y, self.group)
        if self.bias is not None:
            y = y + self.bias
        return y


class Attention(nn.Module):
    """Grouped-query self-attention over this rank's heads (all heads when ``tp_size == 1``).

    ``forward(x [N, hidden], cos, sin, meta, pages, attend) -> [N, hidden]``: projects q/k/v,
    rotates q/k, writes the new K/V into this layer's pages at ``meta.write_index``, attends
    each token causally to its sequence's pages through ``attend`` (the step's bound paged
    attention, :mod:`tpspec.model.attention`) and projects back (summed over the group).
    ``prefix`` (default ``model.layers.{layer}.self_attn``) names the checkpoint tensors;
    ``in_features`` (default ``hidden_size``) is the width q/k/v read. ``fused``: rotary and the
    K/V write in one kernel (:func:`~tpspec.model.fused_triton.rotary_and_write_kv`); deterministic
    layers run that kernel too where :func:`~tpspec.model.deterministic.layer_kernels` gives their
    kernels (it gives ``apply_rotary``'s and ``KVPages.write``'s bits, element by element).
    """

    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, tp_rank: int, group: Any,
                 *, dtype: torch.dtype, device: Any, prefix: str | None = None,
                 in_features: int | None = None, deterministic: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused and not deterministic
        self.deterministic = deterministic
        split = split_heads(cfg, tp_size, tp_rank)
        hd = cfg.head_dim
        self.head_dim = hd
        self.num_heads = split.q_heads
        self.num_kv_heads = split.kv_heads
        self.scale = hd**-0.5
        prefix = prefix or f"model.layers.{layer}.self_attn"
        self.qkv = ColumnParallelLinear(
            in_features or cfg.hidden_size,
            [
                (f"{prefix}.q_proj", cfg.num_heads * hd, split.q_start * hd, split.q_heads * hd),
                (f"{prefix}.k_proj", cfg.num_kv_heads * hd, split.kv_start * hd, split.kv_heads * hd),
                (f"{prefix}.v_proj", cfg.num_kv_heads * hd, split.kv_start * hd, split.kv_heads * hd),
            ],
            cfg.qkv_bias,
            dtype=dtype,
            device=device,
            deterministic=deterministic,
        )
        self.o_proj = RowParallelLinear(
            f"{prefix}.o_proj", cfg.num_heads * hd, cfg.hidden_size, split.q_start * hd, split.q_heads * hd,
            cfg.o_bias, group, tp_size, dtype=dtype, device=device, deterministic=deterministic,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                pages: KVPages, attend: AttendFn) -> torch.Tensor:
        if self.fused or (self.deterministic and det.layer_kernels(x.device) is not None):
            return self.attend_projected(self.qkv(x), cos, sin, meta, pages, attend)
        n = x.shape[0]
        q, k, v = self.qkv(x).split(self.qkv.out_sizes, dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        pages.write(meta.write_index, k, v.contiguous())
        out = attend(q.contiguous(), pages)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def attend_projected(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                         pages: KVPages, attend: AttendFn) -> torch.Tensor:
        """:meth:`forward` after the q/k/v projection ``qkv`` (``fused`` layers): rotary and the K/V
        write in one kernel, attention, o_proj; rotary and the K/V write inside the attention kernel
        where the backend's ``attend`` offers ``rotary_and_attend`` for this step
        (:meth:`~tpspec.model.attention.TritonPagedAttention.rotary_inside`)."""
        n = qkv.shape[0]
        rotary_and_attend = getattr(attend, "rotary_and_attend", None)
        if rotary_and_attend is not None:
            out = rotary_and_attend(qkv, cos, sin, pages)
        else:
            q = fused_kernels().rotary_and_write_kv(qkv, cos, sin, meta.write_index, pages.k, pages.v,
                                                    self.num_heads, self.num_kv_heads, self.head_dim)
            out = attend(q, pages)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward, ``down(silu(gate(x)) * up(x))``, intermediate features split over the group.

    ``forward(x, reduce=None)``: ``reduce`` replaces the all-reduce of the down projection.
    ``prefix`` (default ``model.layers.{layer}.mlp``) names the checkpoint tensors. ``fused``:
    ``silu(gate) * up`` in one kernel (:func:`~tpspec.model.fused_triton.silu_mul`).
    """

    def __init__(self, cfg: ModelConfig, layer: int, tp_size: int, tp_rank: int, group: Any,
                 *, dtype: torch.dtype, device: Any, prefix: str | None = None,
                 deterministic: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.fused = fused and not deterministic
        inter = cfg.intermediate_size
        start, length = split_evenly("intermediate_size", inter, tp_size, tp_rank)
        prefix = prefix or f"model.layers.{layer}.mlp"
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size,
            [(f"{prefix}.gate_proj", inter, start, length), (f"{prefix}.up_proj", inter, start, length)],
            cfg.mlp_bias,
            dtype=dtype,
            device=device,
            deterministic=deterministic,
        )
        self.down = RowParallelLinear(f"{prefix}.down_proj", inter, cfg.hidden_size, start, length, cfg.mlp_bias,
                                      group, tp_size, dtype=dtype, device=device, deterministic=deterministic)

    def forward(self, x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        if self.fused:
            gate_up = self.gate_up
            if use_triton_linear_silu_mul(x, gate_up.weight, gate_up.bias):
                return self.down(gemv_kernels().linear_silu_mul(x, gate_up.weight, gate_up.bias), reduce)
            return self.down_projected(gate_up(x), reduce)
        if self.deterministic:
            return self.down(det.silu_mul(self.gate_up(x)), reduce)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, reduce)

    def norm_forward(self, norm: RMSNorm, x: torch.Tensor,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(h)), h)`` with ``h = x + residual`` (``x`` when ``residual`` is None), for
        ``fused`` layers: the norm inside the gate/up GEMV where
        :meth:`ColumnParallelLinear.takes_norm` says so (a one-row step), else the norm's kernel,
        then :meth:`forward`; either way ``silu(gate) * up`` formed as gate/up stores its output where
        :func:`~tpspec.model.linear.use_triton_linear_silu_mul` says so."""
        gate_up = self.gate_up
        if gate_up.takes_norm(norm, x, residual):
            if use_triton_linear_silu_mul(x, gate_up.weight, gate_up.bias):
                act, h = gemv_kernels().norm_linear_silu_mul(x, residual, norm.weight, norm.eps, gate_up.weight,
                                                             gate_up.bias)
                return self.down(act), h
            y, h = gate_up.norm_forward(norm, x, residual)
            return self.down_projected(y), h
        normed, h = norm.residual_forward(x, residual)
        return self(normed), h

    def down_projected(self, gate_up: torch.Tensor,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """:meth:`forward` after the gate/up projection ``gate_up`` (``fused`` layers):
        ``silu(gate) * up`` in one kernel, then down_proj; both in one where
        :func:`~tpspec.model.linear.use_triton_silu_linear` says so (one row)."""
        if use_triton_silu_linear(gate_up, self.down.weight):
            return self.down.silu_mul_forward(gate_up, reduce)
        return self.down(fused_kernels().silu_mul(gate_up), reduce)
