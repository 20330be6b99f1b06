"""Deterministic mode's arithmetic: every reduction of the forward in a fixed order.

In the default mode the model's logits depend, in their last bits, on the batch around a
row (matmul and attention kernels pick their reduction order by shape) and on the TP size
(a row-parallel layer's partial sums are added in an order the transport picks). Here every
sum is an explicit binary tree whose shape depends only on the GLOBAL length of the axis it
reduces, never on the number of rows, the row's neighbours, the speculation depth or how the
axis is split over ranks. So a row's logits are a function of that row's own tokens and
cache, bit for bit:

* **Contractions** (every linear, the LM head, norms, attention scores). The contraction of
  global length ``K`` is cut into ``S`` segments, ``S`` the largest power of two dividing
  ``K``; each segment (``K / S`` columns, an odd count) is zero-padded to the next power of
  two. The products (float32; exact for 16-bit inputs) of all ``S * Lp`` leaves are summed by
  the binary tree of adjacent pairs. A TP rank of a row-parallel layer holds ``S / tp`` whole
  segments — an aligned subtree — so it sums its subtree, the ranks all-gather those partials
  and sum them by the top of the same tree (:func:`tree_sum_ranks`; never an all-reduce).
  TP 1, 2, 4, 8 give the same bits; a TP size that is not a power of two dividing
  ``min(8, S)`` raises ``ValueError`` (:func:`check_contraction_split`; the bound is the CUDA
  path's, below, and holds on every device so a layout valid on one is valid on the other).
* **Attention** runs per sequence and per query row: scores by the tree over ``head_dim``,
  the max over the visible keys (exact), ``exp`` by :func:`portable_exp` (basic IEEE
  operations only), and the softmax denominator and the weighted sum of values by the tree
  over KV positions ``0 .. visible - 1`` (:func:`prefix_tree_sum`), which never looks at
  positions the row cannot see. A row verified among ``K + 1`` drafts therefore gets the
  logits it gets decoded alone.
* **Elementwise functions** whose CPU kernels differ between their vectorized body and the
  scalar tail (so an element's result could depend on the tensor's size): ``exp`` (softmax,
  SiLU) is :func:`portable_exp`; rotary ``cos``/``sin`` are computed per fixed block of
  positions on CPU (:func:`rotary_cos_sin`), so a position's angles always meet the same
  kernel call (CUDA's elementwise kernels need no such care).

Memory per call stays bounded: products are formed in blocks of rows and columns, and
attention's in aligned power-of-two chunks of KV positions (``BLOCK_ELEMENTS`` at most,
``CUDA_BLOCK_ELEMENTS`` on CUDA; one attention row still holds its ``[kv_heads, n]``
scores); blocking never changes an element's tree.

Every function here is plain torch and runs on CPU and CUDA alike. One exception, by one rule
(:func:`segment_gemm`): on CUDA with ``triton`` importable, :class:`FixedOrderMatmul` (every
linear and LM head) runs the segment GEMM of :mod:`tpspec.model.deterministic_cuda` instead of
forming the products: the contraction is cut into ``min(8, S)`` wide segments, each summed by
the GEMM's fixed K loop, then the same adjacent-pairs tree over segments and ranks. Its bits are
the GPU's own (equal across batches, speculation and TP sizes; not equal to the CPU's). Norms
run the plain-torch trees on CUDA too; attention on CUDA is the Triton kernels of
:mod:`tpspec.model.deterministic_attention_cuda` (chosen by ``DeterministicPagedAttention``).
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed as D

BLOCK_ELEMENTS = 1 << 18  # products formed at once on CPU (1 MiB of float32: stays in cache)
CUDA_BLOCK_ELEMENTS = 1 << 24  # on CUDA (64 MiB): few enough launches to keep the GPU busy


def _block(device: torch.device) -> int:
    return CUDA_BLOCK_ELEMENTS if device.type == "cuda" else BLOCK_ELEMENTS
ROTARY_BLOCK = 64  # positions whose angles one cos/sin call computes (CPU)
MAX_WIDE_SEGMENTS = 8  # the CUDA segment GEMM's segments per contraction: TP up to 8 holds whole ones


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _bit_reverse(n: int) -> torch.Tensor:
    """``[n]`` int64, ``n`` a power of two: index ``m`` -> ``m`` with its ``log2 n`` bits reversed."""
    bits = n.bit_length() - 1
    idx = torch.arange(n, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64)
    for b in range(bits):
        out |= ((idx >> b) & 1) << (bits - 1 - b)
    return out


@dataclass(frozen=True)
class Contraction:
    """The fixed tree of a contraction of global length ``length``: ``segments`` (a power of
    two) segments of ``seg_len`` columns, each padded to ``seg_padded`` (a power of two) leaves."""

    length: int
    segments: int
    seg_len: int
    seg_padded: int

    @classmethod
    def of(cls, length: int) -> "Contraction":
        if length < 1:
            raise ValueError(f"a contraction needs a positive length, got {length}")
        segments = length & -length  # largest power of two dividing length
        seg_len = length // segments
        return cls(length, segments, seg_len, _next_pow2(seg_len))

    @property
    def wide_segments(self) -> int:
        """The segments of the CUDA segment GEMM: ``min(MAX_WIDE_SEGMENTS, segments)``, each
        ``length // wide_segments`` columns (a whole number of the CPU tree's segments)."""
        return min(MAX_WIDE_SEGMENTS, self.segments)

    def local_leaves(self, tp_size: int) -> int:
        return self.segments // tp_size * self.seg_padded

    def storage_source(self, tp_size: int) -> torch.Tensor:
        """``[P]`` int64, ``P = local_leaves(tp_size)``: the local column behind each stored leaf,
        ``length // tp_size`` for a padding leaf. Leaves are stored bit-reversed, so halving the
        stored array (element ``m`` plus element ``m + P/2``) is the adjacent-pairs tree."""
        leaves = self.local_leaves(tp_size)
        natural = torch.arange(leaves, dtype=torch.int64)
        seg, off = natural // self.seg_padded, natural % self.seg_padded
        col = torch.where(off < self.seg_len, seg * self.seg_len + off,
                          torch.full_like(natural, self.length // tp_size))
        return col[_bit_reverse(leaves)]


@functools.lru_cache(maxsize=256)
def leaf_source(length: int, tp_size: int, device: torch.device) -> torch.Tensor:
    """:meth:`Contraction.storage_source` of a contraction of global ``length`` split over
    ``tp_size`` ranks, on ``device`` (made once per shape and device)."""
    return Contraction.of(length).storage_source(tp_size).to(device)


def check_contraction_split(name: str, length: int, tp_size: int) -> None:
    """``ValueError`` unless a contraction of global ``length`` can be split over ``tp_size``
    ranks in deterministic mode on every device: ``tp_size`` a power of two dividing
    :attr:`Contraction.wide_segments` (``min(8, largest power of two dividing length)``), so
    each rank holds whole segments of the CPU tree and of the CUDA segment GEMM's alike."""
    if tp_size < 1 or tp_size & (tp_size - 1):
        raise ValueError(f"deterministic mode needs a power-of-two tp_size, got {tp_size}")
    segments = Contraction.of(length).wide_segments
    if segments % tp_size:
        raise ValueError(f"deterministic mode cannot split {name}={length} over tp_size={tp_size}: its "
                         f"fixed-order tree has {segments} wide segment(s) (at most {MAX_WIDE_SEGMENTS}), "
                         f"a rank must hold whole ones")


def _halve(t: torch.Tensor) -> torch.Tensor:
    """Sum dim 0 (a power of two, bit-reversed leaves) by halving in place; returns ``t[0]``."""
    h = t.shape[0]
    while h > 1:
        h //= 2
        t[:h].add_(t[h : 2 * h])
    return t[0]


def _gather_leaves(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` -> ``[P, M]`` float32 leaves (padding leaves are +0); ``source`` on ``x``'s device."""
    xf = torch.cat((x.to(torch.float32), x.new_zeros(x.shape[0], 1, dtype=torch.float32)), dim=1)
    return xf.index_select(1, source).t().contiguous()


@functools.lru_cache(maxsize=None)
def _triton_module(name: str) -> Any:
    """The Triton module ``tpspec.model.<name>``, or None where ``triton`` does not import."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:  # no triton: the plain-torch trees everywhere
        return None


def segment_gemm(device: torch.device) -> Any:
    """The one dispatch rule of deterministic contractions: on a CUDA ``device`` with
    ``triton`` importable, the module :mod:`tpspec.model.deterministic_cuda` (the segment
    GEMM); otherwise ``None`` (the element tree of :class:`FixedOrderMatmul`)."""
    return _triton_module("deterministic_cuda") if device.type == "cuda" else None


# Whether deterministic mode on CUDA runs the layer kernels of :mod:`tpspec.model.deterministic_cuda`
# (the norm, ``silu * up`` and the segment sums' tree, each bit for bit the torch ops it replaces)
# instead of chains of small torch kernels: on, since tests/test_deterministic_layer_kernels.py's and
# the deterministic GPU tests passed on a GPU with it on.
LAYER_KERNELS_ON_CUDA = True


def layer_kernels(device: torch.device) -> Any:
    """:mod:`tpspec.model.deterministic_cuda` when deterministic layers on ``device`` run its fused
    kernels (CUDA, ``triton`` importable, :data:`LAYER_KERNELS_ON_CUDA` on), else None (torch)."""
    if device.type != "cuda" or not LAYER_KERNELS_ON_CUDA:
        return None
    return _triton_module("deterministic_cuda")


def attention_kernels(device: torch.device) -> Any:
    """The same rule for attention: on a CUDA ``device`` with ``triton`` importable, the module
    :mod:`tpspec.model.deterministic_attention_cuda`; otherwise ``None`` (:func:`attend_sequence`
    per sequence on the host). A CPU run never imports Triton."""
    return _triton_module("deterministic_attention_cuda") if device.type == "cuda" else None


class FixedOrderMatmul:
    """``x [M, K_local] @ W^T`` for a weight ``W [N, K_local]`` holding this rank's
    ``K_local = K / tp_size`` contraction columns (a column-parallel or head layer:
    ``tp_size = 1``) in deterministic order.

    ``partial(x, weight)`` returns this rank's ``[M, N]`` float32 subtree sums, to be summed
    over ranks by :func:`tree_sum_ranks`. Where :func:`segment_gemm` gives the CUDA segment
    GEMM, the subtree is the adjacent-pairs tree over this rank's ``wide_segments / tp_size``
    segments, each summed by the GEMM's fixed K loop (the weight used as it is). Otherwise every
    output element is the tree sum of its float32 products; the weight is then laid out once
    per weight version (a float32 copy in leaf order, kept beside the parameter; laid out again
    when the parameter is modified in place).
    """

    def __init__(self, contraction: Contraction, tp_size: int) -> None:
        self.contraction = contraction
        self.tp_size = tp_size
        self._weight_key: tuple[int, int, torch.device] | None = None
        self._leaves: torch.Tensor | None = None  # [P, N] float32

    def _weight_leaves(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.device)
        if self._weight_key != key:
            self._leaves = _gather_leaves(weight, leaf_source(self.contraction.length, self.tp_size, weight.device))
            self._weight_key = key
        return self._leaves

    def rounded(self, x: torch.Tensor, weight: torch.Tensor, group: Any = None) -> torch.Tensor:
        """The whole contraction in ``x``'s dtype: ``tree_sum_ranks(partial(x, weight), group,
        tp_size).to(x.dtype)`` (``group``: the ranks that hold its parts, where ``tp_size > 1``). A
        contraction one rank holds whole is rounded inside the tree's kernel where the layer kernels
        run (the same bits, no float32 ``[M, N]`` stored and read back)."""
        if self.tp_size != 1:
            if group is None:
                raise ValueError("only a contraction held whole by one rank is rounded without the group of "
                                 "ranks that sum its parts")
            return tree_sum_ranks(self.partial(x, weight), group, self.tp_size).to(x.dtype)
        gemm = segment_gemm(x.device)
        if gemm is not None and layer_kernels(x.device) is not None:
            seg_len = self.contraction.length // self.contraction.wide_segments
            return gemm.tree_sum(gemm.segment_sums(x, weight, seg_len), x.dtype)
        return self.partial(x, weight).to(x.dtype)

    def partial(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        gemm = segment_gemm(x.device)
        if gemm is not None:
            seg_len = self.contraction.length // self.contraction.wide_segments
            if layer_kernels(x.device) is not None:
                return gemm.tree_sum(gemm.segment_sums(x, weight, seg_len))
            return gemm.segment_partial(x, weight, seg_len)
        m, n = x.shape[0], weight.shape[0]
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
        if m == 0 or n == 0:
            return out
        w = self._weight_leaves(weight)  # [P, N]
        xl = _gather_leaves(x, leaf_source(self.contraction.length, self.tp_size, x.device))  # [P, M]
        p = w.shape[0]
        block = _block(x.device)
        nb = max(1, min(n, block // p))
        mb = max(1, min(m, block // (p * nb)))
        for i in range(0, m, mb):
            for j in range(0, n, nb):
                prod = xl[:, i : i + mb, None] * w[:, None, j : j + nb]
                out[i : i + mb, j : j + nb] = _halve(prod)
        return out


def tree_sum_ranks(partial: torch.Tensor, group: Any, tp_size: int) -> torch.Tensor:
    """Sum every rank's ``partial`` (same shape everywhere) by the adjacent-pairs tree over
    ranks ``0 .. tp_size - 1``: one all-gather, then fixed-order adds. Every rank gets the same
    bits. Identity for one rank."""
    if tp_size == 1:
        return partial
    stacked = torch.empty((tp_size,) + tuple(partial.shape), dtype=partial.dtype, device=partial.device)
    D.all_gather_into(stacked.view(-1), partial.contiguous().view(-1), group)
    while stacked.shape[0] > 1:
        stacked = stacked[0::2] + stacked[1::2]
    return stacked[0]


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` -> ``[M]`` float32: each row's tree sum over ``K`` (the contraction tree)."""
    return _halve(_gather_leaves(x, leaf_source(x.shape[1], 1, x.device)))


# --- exp from basic IEEE operations --------------------------------------------------------

_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238  # 32 significant bits: k * _LN2_HI is exact for |k| < 2**20
_LN2_LO = 1.9082149292705877e-10
_EXP_TERMS = 10  # Taylor terms: |r| <= ln2/2 makes the remainder ~1e-11 relative, far below float32


def portable_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` elementwise in ``x.dtype``, computed in float64 from additions,
    multiplications, a rounding and an exponent bit pattern only, so every element's result
    depends on its value alone (not on where it sits in the tensor) on every device.
    ``-inf -> 0``, ``+inf -> inf``, NaN stays NaN."""
    xd = x.to(torch.float64).clamp(-200.0, 200.0)
    xd = torch.where(torch.isnan(xd), torch.zeros_like(xd), xd)
    k = torch.round(xd * _LOG2E)
    r = (xd - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, 1.0 / math.factorial(_EXP_TERMS - 1))
    for n in range(_EXP_TERMS - 2, -1, -1):
        p = p * r + 1.0 / math.factorial(n)
    scale = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    out = (p * scale).to(x.dtype)
    return torch.where(torch.isnan(x), x, out)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` in float32 with :func:`portable_exp`, cast to ``x.dtype``."""
    xf = x.to(torch.float32)
    return (xf / (1.0 + portable_exp(-xf))).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[M, 2I]`` rows holding ``[gate | up]``: ``[M, I]`` in their dtype."""
    kernels = layer_kernels(gate_up.device)
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` per row, the mean of squares by the fixed tree (float32)."""
    kernels = layer_kernels(x.device)
    if kernels is not None and x.dim() == 2:
        return kernels.rms_norm(x, weight, eps, leaf_source(x.shape[1], 1, x.device))
    x32 = x.to(torch.float32)
    mean = fixed_order_sum(x32 * x32) / x.shape[-1]
    x32 = x32 * (1.0 / torch.sqrt(mean + eps))[:, None]
    return weight * x32.to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[N, head_dim]`` of ``positions [N]``, the values of the default formula,
    each position's independent of the others. On CPU they are computed per block of
    ``ROTARY_BLOCK`` consecutive positions: every position's angles always go through a
    cos/sin call of the same shape at the same place in it."""
    device = positions.device
    if device.type == "cuda":
        # A CUDA elementwise kernel computes every element by the same device function whatever
        # the tensor's size or the element's place (no vectorized body beside a scalar tail), so
        # the plain formula is position-free here; it also needs no host sync (CUDA graphs).
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
    if positions.numel() == 0:
        empty = torch.empty(0, 2 * inv_freq.shape[0], dtype=dtype, device=device)
        return empty, empty.clone()
    blocks, where = torch.unique(positions // ROTARY_BLOCK, return_inverse=True)
    block_pos = blocks[:, None] * ROTARY_BLOCK + torch.arange(ROTARY_BLOCK, device=device)[None, :]
    cos_rows, sin_rows = [], []
    for row in block_pos:
        angles = row.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos_rows.append(emb.cos())
        sin_rows.append(emb.sin())
    cos, sin = torch.stack(cos_rows), torch.stack(sin_rows)  # [blocks, ROTARY_BLOCK, hd]
    offset = positions % ROTARY_BLOCK
    return cos[where, offset].to(dtype), sin[where, offset].to(dtype)


# --- attention ------------------------------------------------------------------------------

def prefix_tree_sum(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Sum ``x [..., n]`` over its last axis, each row over positions ``[0, visible)`` only, by
    the adjacent-pairs tree over positions in which a right subtree starting at or past
    ``visible`` is dropped (the left one passes up unchanged). The result depends only on the
    row's first ``visible`` values, not on ``n`` or what lies beyond. ``visible``: int64
    broadcastable to ``x.shape[:-1]``, each >= 1."""
    n = x.shape[-1]
    width = _next_pow2(n)
    if width > n:
        x = torch.cat((x, x.new_zeros(*x.shape[:-1], width - n)), dim=-1)
    vis = visible[..., None]
    span = 1
    while x.shape[-1] > 1:
        pairs = x.unflatten(-1, (-1, 2))
        left, right = pairs[..., 0], pairs[..., 1]
        right_start = (2 * torch.arange(x.shape[-1] // 2, device=x.device) + 1) * span
        x = torch.where(right_start >= vis, left, left + right)
        span *= 2
    return x[..., 0]


def attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cache_len: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of one sequence in fixed order.

    ``q [qn, H, hd]`` (the new tokens), ``keys``/``values`` ``[n, kv_heads, hd]`` (the
    sequence's cache, positions ``0 .. n-1``, ``n >= cache_len + qn``; later positions are
    ignored). Query ``i`` sees positions ``[0, cache_len + i]``. Returns ``[qn, H, hd]`` in
    ``q.dtype``; row ``i`` depends only on query ``i`` and the keys/values it sees.
    """
    qn, heads, hd = q.shape
    n, kvh = keys.shape[0], keys.shape[1]
    g = heads // kvh
    source = leaf_source(hd, 1, q.device)
    # [qn, H, hd] -> leaves [P, kvh, g * qn] (row = j * qn + i for query head kv * g + j)
    ql = _gather_leaves(q.reshape(qn * heads, hd), source).view(-1, qn, kvh, g)
    ql = ql.permute(0, 2, 3, 1).reshape(-1, kvh, g * qn)
    kl = _gather_leaves(keys.reshape(n * kvh, hd), source).view(-1, n, kvh).permute(0, 2, 1)  # [P, kvh, n]
    vf = values.to(torch.float32).permute(1, 2, 0)  # [kvh, hd, n]
    rows = g * qn
    visible = (cache_len + 1 + torch.arange(qn, device=q.device)).repeat(g)  # [rows]
    out = torch.empty(kvh, rows, hd, dtype=torch.float32, device=q.device)
    p_leaves = ql.shape[0]
    # Rows in blocks (a few [kvh, rb, n] tensors at a time); positions in aligned power-of-two
    # chunks, each a subtree of the position tree, so neither blocking changes a sum.
    block = _block(q.device)
    rb = max(1, min(rows, block // (4 * kvh * _next_pow2(n))))
    pos = torch.arange(n, device=q.device)
    for i in range(0, rows, rb):
        vis = visible[i : i + rb]
        r = vis.shape[0]
        chunk = min(_next_pow2(n), _prev_pow2(max(1, block // (kvh * r * max(p_leaves, hd)))))
        scores = torch.empty(kvh, r, n, dtype=torch.float32, device=q.device)
        for s in range(0, n, chunk):
            scores[:, :, s : s + chunk] = _halve(ql[:, :, i : i + r, None] * kl[:, :, None, s : s + chunk])
        scores = scores * scale
        seen = pos[None, None, :] < vis[None, :, None]
        scores = torch.where(seen, scores, torch.full_like(scores, -math.inf))
        top = scores.amax(dim=-1, keepdim=True)
        p = torch.where(seen, portable_exp(scores - top), torch.zeros_like(scores))
        den = prefix_tree_sum(p, vis[None, :])  # [kvh, r]
        parts = [prefix_tree_sum(p[:, :, None, s : s + chunk] * vf[:, None, :, s : s + chunk],
                                 (vis - s).clamp(min=1)[None, :, None])  # a chunk no row sees is dropped below
                 for s in range(0, n, chunk)]
        num = prefix_tree_sum(torch.stack(parts, dim=-1), (-(-vis // chunk))[None, :, None])  # [kvh, r, hd]
        out[:, i : i + r] = num / den[..., None]
    # [kvh, g * qn, hd] -> [qn, H, hd]
    return out.view(kvh, g, qn, hd).permute(2, 0, 1, 3).reshape(qn, heads, hd).to(q.dtype)
