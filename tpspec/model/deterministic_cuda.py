"""Deterministic mode's kernels on CUDA: a fixed-order segment GEMM in Triton, and the layers'
elementwise work (the segment sums' tree, the norm, ``silu * up``) in one kernel each.

A contraction of global length ``K`` is cut into ``G = min(8, K & -K)`` segments of ``K / G``
consecutive columns (:attr:`tpspec.model.deterministic.Contraction.wide_segments`), so every
power-of-two TP size up to 8 holds whole segments. Each segment's float32 sum is computed
by one Triton kernel whose K loop walks the segment in one fixed order: fixed
``BLOCK_M``/``BLOCK_N``/``BLOCK_K`` tiles, fixed warps and pipeline stages, no split-K, no
autotuning, the tail of a segment that is not a multiple of ``BLOCK_K`` masked to zeros. An
output element is therefore accumulated by the same instructions over the same columns
whatever the number of rows ``M``, the row's place in its tile, the number of output columns,
which rank holds the segment or how many segments one launch covers. The segments of a rank
are then summed by the adjacent-pairs tree (elementwise float32 adds: in torch, or the tree
kernel, :func:`tree_sum`), and the ranks' partials by the top of the same tree
(:func:`tpspec.model.deterministic.tree_sum_ranks`).

Why our own kernel: the batch-invariant matmuls of Thinking Machines' ``batch_invariant_ops``
(which vLLM and SGLang ship in their batch-invariant modes) fix the reduction order of the
whole ``K`` inside one GEMM, which makes a row's result independent of the batch but not of
the TP size: a row-parallel layer's ranks each hold ``K / tp`` columns, and one ordered
reduction over ``K`` cannot be cut at a rank boundary. Summing fixed segments separately
makes the cut points part of the tree, so TP = 1, 2, 4, 8 add the same segment sums in the
same order.

The bits are the GPU's own: equal across batches, speculation and TP sizes on one device
and build, not equal to the CPU tree of :mod:`tpspec.model.deterministic`.

The layer kernels (:func:`tree_sum`, :func:`rms_norm`, :func:`silu_mul`) replace chains of small
torch kernels and give their bits exactly: the same float32 (and, for ``exp``, float64) operations in
the same order, each rounded once (``enable_fp_fusion=False``, division and square root correctly
rounded), the norm's mean of squares by the contraction tree's halving, its division by the width a
multiplication by the width's float32 reciprocal as torch does on CUDA. So deterministic mode's
invariances hold with them as without; :data:`tpspec.model.deterministic.LAYER_KERNELS_ON_CUDA` turns
them on.

Import this module only for CUDA tensors (it needs ``triton``; Triton's interpreter runs it on CPU
tensors in the tests); the dispatch is :func:`tpspec.model.deterministic.segment_gemm` and
:func:`tpspec.model.deterministic.layer_kernels`.
"""

from __future__ import annotations

import functools
import math

import numpy
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_LOCAL_SEGMENTS = 8  # segments of one rank (the wide segments of a contraction, at TP = 1)

# Fixed launch constants: they never depend on M, N, K or the number of segments (changing
# any of them changes the bits, equally everywhere).
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 3


@triton.jit
def _segment_sum(x_tile, w_tile, row_ok, col_ok, stride_xm, stride_wn, k0, SEG_LEN: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` float32: the sum over columns ``k0 .. k0 + SEG_LEN - 1`` of the
    tile's rows of ``x`` (from ``x_tile``) times its rows of ``w`` (from ``w_tile``), from
    zero, by the K loop in ascending blocks of ``BLOCK_K`` columns (the tail block's missing
    columns load as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_tile + k0 + tl.arange(0, BLOCK_M)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_tile + k0 + tl.arange(0, BLOCK_N)[:, None] * stride_wn + ks[None, :]
    for k in range(0, SEG_LEN, BLOCK_K):
        k_ok = (k + ks) < SEG_LEN
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:  # float32 inputs: float32 FMAs, not TF32
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:  # 16-bit inputs: tensor cores, float32 accumulation
            acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _tile(pid_m, pid_n, x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Output tile ``(pid_m, pid_n)``: its first row and column, where its rows of ``x`` and of ``w``
    start, and which of its rows and columns exist. The first row and column are 64-bit offsets
    (a big weight passes 2^31 elements); offsets inside the tile stay 32-bit."""
    row0 = pid_m.to(tl.int64) * BLOCK_M
    col0 = pid_n.to(tl.int64) * BLOCK_N
    x_tile = x_ptr + row0 * stride_xm
    w_tile = w_ptr + col0 * stride_wn
    row_ok = tl.arange(0, BLOCK_M) < M - row0
    col_ok = tl.arange(0, BLOCK_N) < N - col0
    return row0, col0, x_tile, w_tile, row_ok, col_ok


@triton.jit(do_not_specialize=["M", "N"])
def _segment_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, SEG_LEN: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(i, j, s)``: rows tile ``i``, columns tile ``j``, segment ``s``, its sum written to
    ``out[s, rows, cols]`` (``out [G_local, M, N]`` float32).

    One segment a program, never two: adding a second segment's sum to the first inside the
    kernel lets the compiler fold the addition into that segment's first tile product (the
    product then starts from the first sum instead of from zero), which rounds differently from
    the adjacent-pairs tree; the segments are therefore added outside, in torch."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    row0, col0, x_tile, w_tile, row_ok, col_ok = _tile(pid_m, pid_n, x_ptr, w_ptr, M, N, stride_xm, stride_wn, BLOCK_M,
                                                       BLOCK_N)
    k0 = pid_s * SEG_LEN
    acc = _segment_sum(x_tile, w_tile, row_ok, col_ok, stride_xm, stride_wn, k0,
                       SEG_LEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    out_tile = out_ptr + (pid_s.to(tl.int64) * M + row0) * N + col0
    out = out_tile + tl.arange(0, BLOCK_M)[:, None] * N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def _operands(x: torch.Tensor, weight: torch.Tensor, seg_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K_local] and weight [N, K_local] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    k_local = x.shape[1]
    if seg_len < 1 or k_local % seg_len:
        raise ValueError(f"K_local={k_local} is not a whole number of segments of {seg_len} columns")
    local = k_local // seg_len
    if local & (local - 1) or local > MAX_LOCAL_SEGMENTS:
        raise ValueError(f"a rank must hold a power-of-two number of segments up to {MAX_LOCAL_SEGMENTS}, "
                         f"got {local}")
    if x.dtype != weight.dtype:  # one dtype per dot: both in float32 (exact for 16-bit values)
        x, weight = x.to(torch.float32), weight.to(torch.float32)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the segment GEMM takes float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    return x, weight, local


def segment_sums(x: torch.Tensor, weight: torch.Tensor, seg_len: int) -> torch.Tensor:
    """One launch: ``[local, M, N]`` float32, entry ``s`` the sum of segment ``s``.

    ``x [M, K_local]`` and ``weight [N, K_local]`` (float16, bfloat16 or float32; mixed dtypes
    are both taken to float32) on one CUDA device (or CPU tensors under
    ``TRITON_INTERPRET=1``); ``K_local = local * seg_len`` with ``local`` a power of two up to
    ``MAX_LOCAL_SEGMENTS``: this rank's whole segments, segment ``s`` being columns
    ``s * seg_len .. (s + 1) * seg_len - 1``. Each element depends only on its row of ``x``,
    its row of ``weight`` and ``seg_len`` (one compiled kernel per ``seg_len`` and dtype).
    """
    x, weight, local = _operands(x, weight, seg_len)
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty(local, m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    # FP fusion pinned on, as every GPU run compiled these kernels (Triton 3.10 turns its default off).
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), local)
    _segment_gemm_kernel[grid](x, weight, out, m, n, x.stride(0), weight.stride(0), SEG_LEN=seg_len,
                               IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                               num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=True)
    return out


def segment_partial(x: torch.Tensor, weight: torch.Tensor, seg_len: int) -> torch.Tensor:
    """``[M, N]`` float32: this rank's subtree of the contraction, the adjacent-pairs tree over
    its segment sums (:func:`segment_sums`; shapes and dtypes as there), added in torch."""
    sums = segment_sums(x, weight, seg_len)
    while sums.shape[0] > 1:  # adjacent pairs: elementwise float32 adds, fixed order
        sums = sums[0::2] + sums[1::2]
    return sums[0]


# ------------------------------------------------------------------ the layers' elementwise work

@triton.jit
def _tree_sum_kernel(sums_ptr, out_ptr, count, G: tl.constexpr, BLOCK: tl.constexpr):
    """``out[e] = sum_s sums[s, e]`` by the adjacent-pairs tree over ``G`` segment sums (``G`` a power of two),
    rounded once to ``out``'s dtype (round to nearest even, as torch casts)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < count
    s = tl.load(sums_ptr + tl.arange(0, G)[:, None].to(tl.int64) * count + i[None, :], mask=ok[None, :], other=0.0)
    for level in tl.static_range(G.bit_length() - 1):
        # Rows 2j and 2j + 1 become row j: the adjacent pair, one float32 add each.
        s = tl.sum(tl.reshape(s, (G >> (level + 1), 2, BLOCK)), axis=1)
    tl.store(out_ptr + i, tl.reshape(s, (BLOCK,)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, leaves_ptr, out_ptr, hidden, stride_x, stride_o, inv_hidden, eps,
                     LEAVES: tl.constexpr, BLOCK: tl.constexpr):
    """One row: the mean of squares by the contraction tree (leaves in stored order, halved: leaf m
    plus leaf m + P/2), times ``inv_hidden``; then ``x * (1 / sqrt(mean + eps))`` cast to the
    dtype, times the weight."""
    row = tl.program_id(0).to(tl.int64)
    source = tl.load(leaves_ptr + tl.arange(0, LEAVES))
    leaf = tl.load(x_ptr + row * stride_x + source, mask=source < hidden, other=0.0).to(tl.float32)
    s = leaf * leaf
    for level in tl.static_range(LEAVES.bit_length() - 1):
        s = tl.sum(tl.reshape(s, (2, LEAVES >> (level + 1))), axis=0)  # first half plus second half
    mean = tl.sum(s, axis=0) * inv_hidden  # the one leaf left
    scale = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    y = (x.to(tl.float32) * scale).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    product = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, product.to(out_ptr.dtype.element_ty), mask=ok)


_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(0.6931471803691238)
_LN2_LO = tl.constexpr(1.9082149292705877e-10)
_INV_FACTORIALS = [tl.constexpr(1.0 / math.factorial(n)) for n in range(10)]
_F0, _F1, _F2, _F3, _F4, _F5, _F6, _F7, _F8, _F9 = _INV_FACTORIALS


@triton.jit
def _f64(value):
    return tl.full([], value, tl.float64)


@triton.jit
def _portable_exp(x):
    """``tpspec.model.deterministic.portable_exp`` of float32 ``x``, to float32: float64 additions
    and multiplications, a rounding and an exponent bit pattern."""
    xd = tl.minimum(tl.maximum(x.to(tl.float64), -200.0), 200.0)
    xd = tl.where(x != x, 0.0, xd)
    y = xd * _f64(_LOG2E)
    # torch.round: to nearest, ties to even (y - floor(y) is exact: |y| < 2**9).
    low = tl.floor(y)
    frac = y - low
    odd = (low.to(tl.int64) & 1) != 0
    k = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)
    r = (xd - k * _f64(_LN2_HI)) - k * _f64(_LN2_LO)
    p = tl.full(r.shape, _F9, tl.float64)
    p = p * r + _f64(_F8)
    p = p * r + _f64(_F7)
    p = p * r + _f64(_F6)
    p = p * r + _f64(_F5)
    p = p * r + _f64(_F4)
    p = p * r + _f64(_F3)
    p = p * r + _f64(_F2)
    p = p * r + _f64(_F1)
    p = p * r + _f64(_F0)
    scale = ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    out = (p * scale).to(tl.float32)
    return tl.where(x != x, x, out)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    """``silu(gate) * up`` of one row's ``[gate | up]``: ``gate / (1 + exp(-gate))`` in float32 with
    the portable ``exp``, cast to the dtype, times ``up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = tl.math.div_rn(g, 1.0 + _portable_exp(-g)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


INTERPRETED = isinstance(_tree_sum_kernel, InterpretedFunction)
_ELEMENTS = 1024  # elements one tree-sum or silu program handles


def tree_sum(sums: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[G, M, N]`` float32 (``G`` a power of two) -> ``[M, N]`` in ``dtype`` (float32, float16 or
    bfloat16): the adjacent-pairs tree over dim 0 in one kernel, bit for bit ``while len(s) > 1:
    s = s[0::2] + s[1::2]`` and then ``.to(dtype)``."""
    g = sums.shape[0]
    if g & (g - 1):
        raise ValueError(f"the tree sums a power-of-two number of segments, got {g}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the tree's sums are rounded to float32, float16 or bfloat16, got {dtype}")
    sums = sums.contiguous()
    out = torch.empty(sums.shape[1:], dtype=dtype, device=sums.device)
    count = out.numel()
    if count:
        _tree_sum_kernel[(triton.cdiv(count, _ELEMENTS),)](sums, out, count, G=g, BLOCK=_ELEMENTS, num_warps=4,
                                                           enable_fp_fusion=False)
    return out


@functools.lru_cache(maxsize=None)
def _inverse(width: int) -> float:
    """``1 / width`` rounded to float32, as torch's CUDA division by a Python number multiplies by it."""
    return float(numpy.float32(1.0) / numpy.float32(width))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, leaves: torch.Tensor) -> torch.Tensor:
    """``tpspec.model.deterministic.rms_norm`` in one kernel a row, bit for bit the torch ops on
    CUDA (where dividing by the width is multiplying by its float32 reciprocal): ``x [M, H]``,
    ``weight [H]`` (its dtype is the output's), ``leaves`` the contraction's stored leaf order
    (``leaf_source(H, 1, device)``)."""
    rows, hidden = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows and hidden:
        _rms_norm_kernel[(rows,)](x, weight, leaves, out, hidden, x.stride(0), out.stride(0), _inverse(hidden), eps,
                                  LEAVES=leaves.numel(), BLOCK=triton.next_power_of_2(hidden),
                                  num_warps=min(16, max(1, triton.next_power_of_2(hidden) // 512)),
                                  enable_fp_fusion=False)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[M, 2I]`` (gate columns, then up) -> ``[M, I]``: ``deterministic.silu(gate) * up`` in one
    kernel, bit for bit the torch ops."""
    rows, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        _silu_mul_kernel[(rows, triton.cdiv(inter, _ELEMENTS))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                               BLOCK=_ELEMENTS, num_warps=4, enable_fp_fusion=False)
    return out
