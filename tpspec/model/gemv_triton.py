"""A Triton GEMV for decode-sized batches: ``y = x W^T + b`` with few rows of ``x`` (at most 64).

Decode reads every weight once per step for a handful of rows, so the time is the time to
stream ``W`` from memory. The kernel is built for that:

* **Programs own output features.** Program ``(j, s)`` holds features ``[j * BLOCK_N, (j + 1) *
  BLOCK_N)`` and every row of ``x``, so each weight element is read once, in ``[BLOCK_N, BLOCK_K]``
  tiles along ``W``'s contiguous rows: 16-byte loads when ``K`` is a multiple of 8 and the pointers
  are 16-byte aligned (Triton's argument specialisation sees both), in a K loop pipelined by
  ``tl.range`` stages (the next tiles are in flight while one is summed).
* **Two products, by rows.** One row multiplies each tile elementwise into a ``[BLOCK_N, BLOCK_K]``
  float32 accumulator that is summed along ``K`` once at the end. Two to four rows (``FEW_ROWS``) do
  the same for each row, one weight tile feeding four accumulators (rows past ``M`` are zeros that
  are never read): a verification step of one request's four rows reads its weights as a decode
  step does. More rows pad ``x`` to 16, 32 or 64 rows (the next power of two) and use ``tl.dot``
  (the tensor cores; float32 in IEEE precision); the padding costs compute, which decode has
  spare, and no extra weight traffic.
* **Split-K.** When the feature blocks alone are too few to keep a few programs on every SM
  (``o_proj`` and ``down_proj`` at 4096 features), the contraction is cut into ``splits`` equal
  runs of whole ``BLOCK_K`` tiles; each program stores its float32 partial and ``_reduce_kernel``
  sums the splits in split order (no atomics), adds the bias and casts. With ``LAST_SPLIT_SUMS``
  the last program of a feature block to finish does that sum itself, in the same order (the same
  bits), found by a per-block counter (:mod:`tpspec.model.split_counters`): one kernel fewer a
  split linear (one row and the ``tl.dot`` rows; the few-rows kernels below always reduce by kernel).

* **The norm in front** (:func:`norm_linear`). A decoder's q/k/v and gate/up follow an
  RMSNorm; ``W (h * g) * rsqrt(mean(h^2) + eps)`` is the same product, so the K loop that streams
  ``W`` also sums ``h^2`` and the scale is applied once at the end (by the split reduction where
  the contraction is split): no norm kernel runs first, and the first feature block's programs
  store the residual sum ``h`` the next layer needs. One row has a kernel of its own, and two to
  four rows one that does the same for each row; more rows feed ``h * g``, rounded to the dtype, to
  the ``tl.dot``.

* **SwiGLU in front** (:func:`silu_mul_linear`). A down projection's input is ``silu(gate) * up``;
  the K loop forms each element from the gate/up row as it loads it (the ``silu_mul`` kernel's
  arithmetic), so that kernel does not run and its output is never stored.
* **SwiGLU after** (:func:`linear_silu_mul`, :func:`norm_linear_silu_mul`). A gate/up projection's
  output feeds ``silu(gate) * up``; each program reads half a block of gate rows and the up rows of
  the same features, so it stores ``silu(gate) * up`` of its features itself (the values of
  :func:`linear` followed by the ``silu_mul`` kernel), and the ``[M, 2 I]`` projection is never stored.
* **Dependent launch.** Where :func:`tpspec.model.dependent_launch.use_pdl` says so, every kernel
  here launches with programmatic dependent launch: the GEMVs load their first weight tile, then
  wait for the kernel before (whose output is their ``x``), then stream the rest.

Everything accumulates in float32. The launch (:func:`plan_gemv`) depends only on ``(M, N, K)``,
the dtype and the device's SM count, so results are the same bits for a given shape on a given
device, and nothing synchronizes with the host: a call can be captured in a CUDA graph (the split
partials are allocated by the caller's allocator, the graph pool during a capture).

This module imports ``triton``; :mod:`tpspec.model.linear` holds the switch and the rule that
decide when the decoder's linears call it. Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported) runs the same kernels on CPU tensors, which is how the CPU tests check
them (:data:`INTERPRETED` says which mode this import got).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .dependent_launch import pdl_args
from .fused_triton import silu_mul_values
from .split_counters import last_split, split_counters

MAX_ROWS = 64  # rows of x one call handles (the dot path pads to a power of two, at least 16)
ONE_ROW_TILE = (16, 256)  # one row: [features, contraction] of a weight tile
ONE_ROW_STAGES = 3  # one row: software-pipeline stages of the K loop
# One row: split K until the programs reach this many per SM. Fewer splits mean fewer partial sums to reduce,
# but a program must keep enough loads in flight: docs/benchmarks.md ("Batch 1") compares 1, 2 and 4.
ONE_ROW_PROGRAMS_PER_SM = 2
# Two to FEW_ROWS rows: the one-row product for each row (four accumulators), on [features, contraction] tiles of
# FEW_ROWS_TILE (four accumulators of an [8, 256] tile are 64 float32 registers a thread). 256 columns: a warp's 32
# threads hold one row of the tile, 8 columns each, as at one row; docs/benchmarks.md compares the tiles.
FEW_ROWS = 4
FEW_ROWS_TILE = (8, 256)
FEW_ROWS_STAGES = 3
FEW_ROWS_PROGRAMS_PER_SM = 2
# More rows: [features, contraction] of a weight tile (into a tl.dot of 16 to 64 rows), warps a program, and which
# operand the weight tile is. The tile on the left (W x^T: its 64 features fill the rows of Hopper's warpgroup
# product, which a few rows of x padded to 16 cannot) read the layers' linears faster than x on the left with the
# [64, 64] tiles of 8 warps before, and [64, 128] tiles of 4 warps in 3 stages were the fastest of ten tile shapes
# (docs/benchmarks.md, "The linears alone"). No value spills to local memory (tests/test_gemv_triton.py).
ROWS_TILE = (64, 128)
ROWS_WARPS = 4
ROWS_STAGES = 3  # more rows, 16-bit weights: pipeline stages of the K loop (float32: 2)
ROWS_PROGRAMS_PER_SM = 2  # more rows: split K until the programs reach this many per SM
ROWS_WEIGHTS_LEFT = True  # False: x W^T, x padded to 16 to 64 rows as the left operand
MAX_SPLITS = 16
# Whether a split launch's last program to finish sums the splits itself (no reduction kernel): off until a GPU run
# checks it; see tpspec.model.split_counters.
LAST_SPLIT_SUMS = False
REDUCE_BLOCK = 256  # features per program of the split reduction
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr, W_LEFT: tl.constexpr):
    """The tensor cores' product of ``x`` ``[M_PAD, BLOCK_K]`` and ``w`` ``[BLOCK_N, BLOCK_K]`` added to
    ``acc``: ``acc + x @ w.T`` (``acc`` ``[M_PAD, BLOCK_N]``), or with ``W_LEFT`` ``acc + w @ x.T``
    (``acc`` ``[BLOCK_N, M_PAD]``: the weight tile as the left operand, whose rows may fill an
    instruction's 64 that a few rows of ``x`` cannot). ``IEEE``: float32 multiplied in IEEE precision."""
    if W_LEFT:
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    else:
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _dot_zeros(M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, W_LEFT: tl.constexpr):
    """The float32 accumulator :func:`_dot` adds to: ``[BLOCK_N, M_PAD]`` with ``W_LEFT``, else ``[M_PAD, BLOCK_N]``."""
    if W_LEFT:
        acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    return acc


@triton.jit
def _dot_rows(acc, W_LEFT: tl.constexpr):
    """:func:`_dot`'s accumulator as ``[M_PAD, BLOCK_N]``."""
    if W_LEFT:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _gemv_fold(acc, w, x_ptr, k, m, m_ok, K, stride_xm, USE_DOT: tl.constexpr, EVEN: tl.constexpr,
               IEEE: tl.constexpr, SILU_MUL: tl.constexpr, ACCURATE_EXP: tl.constexpr, W_LEFT: tl.constexpr):
    """One weight tile ``w`` ``[BLOCK_N, BLOCK_K]`` (columns ``k``) times x's columns ``k``, added to ``acc``.
    ``SILU_MUL``: x's row holds ``cat(gate, up)`` (``2 K`` wide) and the product's input is ``silu(gate) * up``."""
    if USE_DOT:
        rows = x_ptr + m[:, None] * stride_xm + k[None, :]
        if EVEN:
            ok = m_ok[:, None]
        else:
            ok = m_ok[:, None] & (k < K)[None, :]
        x = tl.load(rows, mask=ok, other=0.0)
        if SILU_MUL:
            x = silu_mul_values(x, tl.load(rows + K, mask=ok, other=0.0), ACCURATE_EXP)
        acc = _dot(x, w, acc, IEEE, W_LEFT)
    else:
        if EVEN:
            x = tl.load(x_ptr + k)
            if SILU_MUL:
                x = silu_mul_values(x, tl.load(x_ptr + K + k), ACCURATE_EXP)
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            if SILU_MUL:
                x = silu_mul_values(x, tl.load(x_ptr + K + k, mask=k < K, other=0.0), ACCURATE_EXP)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc


@triton.jit
def _tile_features(pid_n, N, BLOCK_N: tl.constexpr, SILU_MUL_OUT: tl.constexpr):
    """The ``[BLOCK_N]`` rows of ``W`` (``N`` rows) that feature block ``pid_n`` reads, and which exist.
    ``SILU_MUL_OUT``: ``W`` is ``cat(gate, up)`` and the block's first half reads gate rows ``pid_n *
    BLOCK_N / 2 + i``, its second half the up rows of the same features (``N / 2`` further on)."""
    r = tl.arange(0, BLOCK_N)
    if SILU_MUL_OUT:
        HALF: tl.constexpr = BLOCK_N // 2
        feature = pid_n * HALF + r % HALF
        n = tl.where(r < HALF, feature, N // 2 + feature)
        n_ok = feature < N // 2
    else:
        n = pid_n * BLOCK_N + r
        n_ok = n < N
    return n, n_ok


@triton.jit
def _store_out(acc, m, m_ok, n, n_ok, pid_n, N, b_ptr, out_ptr, stride_om, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_BIAS: tl.constexpr, SILU_MUL_OUT: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """``acc`` ``[M_PAD, BLOCK_N]`` (W's rows ``n``), plus the bias, rounded to the output's dtype and
    stored; with ``SILU_MUL_OUT`` (:func:`_tile_features`'s halves) ``silu(gate) * up`` of the rounded
    halves is stored instead, at the block's ``BLOCK_N / 2`` features of the ``N / 2`` wide output."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if SILU_MUL_OUT:
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(y, [M_PAD, 2, HALF]), [0, 2, 1]))
        cols = pid_n * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + m[:, None] * stride_om + cols[None, :], silu_mul_values(gate, up, ACCURATE_EXP),
                 mask=m_ok[:, None] & (cols < N // 2)[None, :])
    else:
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _load_w(w_rows, k, n_ok, K, EVEN: tl.constexpr):
    if EVEN:  # every tile lies inside W: no masks, so nothing stands in the way of vector loads
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 k_iters, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                 EVEN: tl.constexpr, SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 IEEE: tl.constexpr, NUM_STAGES: tl.constexpr, SILU_MUL: tl.constexpr, SILU_MUL_OUT: tl.constexpr,
                 ACCURATE_EXP: tl.constexpr, W_LEFT: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n, n_ok = _tile_features(pid_n, N, BLOCK_N, SILU_MUL_OUT)
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    kk = tl.arange(0, BLOCK_K)
    k_first = split * k_iters * BLOCK_K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if USE_DOT:
        acc = _dot_zeros(M_PAD, BLOCK_N, W_LEFT)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # summed along K once, after the loop
    first = 0
    if PDL:
        # The first weight tile streams in while the kernel before is finishing (no kernel of a
        # step writes weights); x, written by that kernel, only after the wait.
        w = _load_w(w_rows, k_first + kk, n_ok, K, EVEN)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc = _gemv_fold(acc, w, x_ptr, k_first + kk, m, m_ok, K, stride_xm, USE_DOT, EVEN, IEEE, SILU_MUL,
                         ACCURATE_EXP, W_LEFT)
        first = 1
    for i in tl.range(first, k_iters, num_stages=NUM_STAGES):
        k = k_first + i * BLOCK_K + kk
        w = _load_w(w_rows, k, n_ok, K, EVEN)
        acc = _gemv_fold(acc, w, x_ptr, k, m, m_ok, K, stride_xm, USE_DOT, EVEN, IEEE, SILU_MUL, ACCURATE_EXP,
                         W_LEFT)
    if USE_DOT:
        acc = _dot_rows(acc, W_LEFT)
    else:
        acc = tl.sum(acc, 1)[None, :]  # [1, BLOCK_N]; M_PAD == 1
    ok = m_ok[:, None] & n_ok[None, :]
    last = not SPLIT
    if SPLIT:
        tl.store(part_ptr + (split * M + m[:, None]) * N + n[None, :], acc, mask=ok)
        if LAST_SUMS:
            last = last_split(count_ptr + pid_n, tl.num_programs(1))
            if last:
                # _reduce_kernel's sum, in its order: the same bits.
                acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
                for s in range(0, tl.num_programs(1)):
                    acc += tl.load(part_ptr + (s * M + m[:, None]) * N + n[None, :], mask=ok, other=0.0,
                                   cache_modifier=".cg")
                tl.store(count_ptr + pid_n, 0)  # ready for the next launch
    if last:
        _store_out(acc, m, m_ok, n, n_ok, pid_n, N, b_ptr, out_ptr, stride_om, M_PAD, BLOCK_N, HAS_BIAS, SILU_MUL_OUT,
                   ACCURATE_EXP)


@triton.jit
def _split_sum(part_ptr, b_ptr, row, n, ok, M, N, splits, HAS_BIAS: tl.constexpr):
    """Features ``n`` of ``row``: the splits' partials summed in split order (the same sum on every
    call), plus the bias, in float32."""
    acc = tl.zeros(n.shape, tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, splits, stride_om, HAS_BIAS: tl.constexpr,
                   SILU_MUL_OUT: tl.constexpr, ACCURATE_EXP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # SILU_MUL_OUT: the partials are cat(gate, up) (N wide), the output silu(gate) * up (N / 2 wide).
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = N // 2 if SILU_MUL_OUT else N
    ok = n < width
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    y = _split_sum(part_ptr, b_ptr, row, n, ok, M, N, splits, HAS_BIAS).to(out_ptr.dtype.element_ty)
    if SILU_MUL_OUT:
        up = _split_sum(part_ptr, b_ptr, row, width + n, ok, M, N, splits, HAS_BIAS).to(out_ptr.dtype.element_ty)
        y = silu_mul_values(y, up, ACCURATE_EXP)
    tl.store(out_ptr + row * stride_om + n, y, mask=ok)


@triton.jit
def _norm_fold(acc_nk, sq, w, x_ptr, res_ptr, g_ptr, h_ptr, k, K, h_end, EVEN: tl.constexpr, HAS_RES: tl.constexpr):
    """One weight tile of :func:`_norm_gemv_kernel`: ``h`` over columns ``k`` (stored by the first feature
    block's programs), its squares into ``sq``, ``w * (h * g)`` into ``acc_nk``."""
    k_ok = k < K
    if EVEN:
        x = tl.load(x_ptr + k)
        g = tl.load(g_ptr + k)
    else:
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0)
    if HAS_RES:
        if EVEN:
            r = tl.load(res_ptr + k)
        else:
            r = tl.load(res_ptr + k, mask=k_ok, other=0.0)
        # The sum rounded once to the dtype (what torch's ``x + residual`` gives).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + k, x, mask=k < h_end)
    h = x.to(tl.float32)
    return acc_nk + w.to(tl.float32) * (h * g.to(tl.float32))[None, :], sq + h * h


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, h_ptr, part_ptr, sq_ptr, count_ptr, N, K,
                      stride_wn, k_iters, k_f, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                      SPLIT: tl.constexpr, LAST_SUMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    # One row: y = rstd * (W (h * g)) with h = x + residual, rstd = rsqrt(mean(h^2) + eps). The K
    # loop that streams W also sums h^2, so no program waits for a norm kernel before it.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    k_first = split * k_iters * BLOCK_K
    h_end = K - pid_n * K  # the first feature block's programs store h (K for them, <= 0 for the rest)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc_nk = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    first = 0
    if PDL:
        # As in _gemv_kernel: the first weight tile before the wait, x and the residual after it.
        w = _load_w(w_rows, k_first + kk, n_ok, K, EVEN)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc_nk, sq = _norm_fold(acc_nk, sq, w, x_ptr, res_ptr, g_ptr, h_ptr, k_first + kk, K, h_end, EVEN, HAS_RES)
        first = 1
    for i in tl.range(first, k_iters, num_stages=NUM_STAGES):
        k = k_first + i * BLOCK_K + kk
        w = _load_w(w_rows, k, n_ok, K, EVEN)
        acc_nk, sq = _norm_fold(acc_nk, sq, w, x_ptr, res_ptr, g_ptr, h_ptr, k, K, h_end, EVEN, HAS_RES)
    acc = tl.sum(acc_nk, 1)  # [BLOCK_N]
    last = not SPLIT
    if SPLIT:
        tl.store(part_ptr + split * N + n, acc, mask=n_ok)
        if not LAST_SUMS:
            sq_at = sq_ptr + split
            total = tl.sum(sq, 0)
            tl.store(sq_at, total, mask=pid_n == 0)  # the same sums in every block: block 0's
        else:
            # Every program stores the squares of its split ([splits, feature blocks]): the last
            # program of a block reads its own block's, counted with it.
            blocks = tl.num_programs(0)
            total = tl.sum(sq, 0)
            tl.store(sq_ptr + split * blocks + pid_n, total)
            last = last_split(count_ptr + pid_n, tl.num_programs(1))
            if last:
                # _norm_reduce_kernel's sums, in its order: the same bits.
                acc = tl.load(part_ptr + n, mask=n_ok, other=0.0, cache_modifier=".cg")
                total = tl.load(sq_ptr + pid_n, cache_modifier=".cg")
                for s in range(1, tl.num_programs(1)):
                    acc += tl.load(part_ptr + s * N + n, mask=n_ok, other=0.0, cache_modifier=".cg")
                    total += tl.load(sq_ptr + s * blocks + pid_n, cache_modifier=".cg")
                tl.store(count_ptr + pid_n, 0)  # ready for the next launch
    if last:
        if SPLIT:
            acc = acc * tl.math.rsqrt(tl.math.div_rn(total, k_f) + eps)
        else:
            acc = acc * tl.math.rsqrt(tl.math.div_rn(tl.sum(sq, 0), k_f) + eps)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _norm_reduce_kernel(part_ptr, sq_ptr, b_ptr, out_ptr, N, splits, k_f, eps, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.load(part_ptr + n, mask=ok, other=0.0)
    sq = tl.load(sq_ptr)
    for s in range(1, splits):  # split order: the same sums on every call
        acc += tl.load(part_ptr + s * N + n, mask=ok, other=0.0)
        sq += tl.load(sq_ptr + s)
    acc = acc * tl.math.rsqrt(tl.math.div_rn(sq, k_f) + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_norm_rows(acc, sq, m, n, n_ok, M, N, split, pid_n, part_ptr, sq_ptr, b_ptr, out_ptr, stride_om, k_f, eps,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU_MUL_OUT: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """The several-row norm kernels' end: ``acc`` ``[M_PAD, BLOCK_N]`` (W's rows ``n``) and the rows'
    squares ``sq`` stored as split partials (``_norm_rows_reduce_kernel`` finishes them), or scaled by
    each row's ``rsqrt`` and stored as :func:`_store_out` stores."""
    m_ok = m < M
    if SPLIT:
        tl.store(part_ptr + (split * M + m[:, None]) * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
        tl.store(sq_ptr + split * M + m, sq, mask=m < M - pid_n * M)  # the same sums in every block: block 0's
    else:
        acc = acc * tl.math.rsqrt(tl.math.div_rn(sq, k_f) + eps)[:, None]
        _store_out(acc, m, m_ok, n, n_ok, pid_n, N, b_ptr, out_ptr, stride_om, M_PAD, BLOCK_N, HAS_BIAS, SILU_MUL_OUT,
                   ACCURATE_EXP)


@triton.jit
def _norm_rows_fold(acc, sq, w, x_ptr, res_ptr, g_ptr, h_ptr, k, m, m_ok, K, h_end, stride_xm, stride_rm, stride_hm,
                    HAS_RES: tl.constexpr, IEEE: tl.constexpr, W_LEFT: tl.constexpr):
    """One weight tile of :func:`_norm_rows_kernel`: ``H`` over columns ``k`` (stored by the first feature
    block's programs), its squares into ``sq``, ``(H * g)`` rounded to the dtype into the product."""
    k_ok = k < K
    ok = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=ok, other=0.0)
    g = tl.load(g_ptr + k, mask=k_ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + m[:, None] * stride_rm + k[None, :], mask=ok, other=0.0)
        # The sum rounded once to the dtype (what torch's ``x + residual`` gives).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + m[:, None] * stride_hm + k[None, :], x, mask=ok & (k < h_end)[None, :])
    h = x.to(tl.float32)
    a = (h * g.to(tl.float32)[None, :]).to(x.dtype)
    return _dot(a, w, acc, IEEE, W_LEFT), sq + tl.sum(h * h, 1)


@triton.jit
def _norm_rows_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, h_ptr, part_ptr, sq_ptr, M, N, K, stride_xm,
                      stride_rm, stride_hm, stride_om, stride_wn, k_iters, k_f, eps, M_PAD: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, NUM_STAGES: tl.constexpr,
                      SILU_MUL_OUT: tl.constexpr, ACCURATE_EXP: tl.constexpr, W_LEFT: tl.constexpr,
                      PDL: tl.constexpr):
    # Several rows: Y = rstd * ((H * g) W^T), H = X + residual, each row's rstd from its own sum of
    # squares, which the K loop that streams W gathers as it goes. H * g is rounded to the dtype for
    # the tensor cores' product (float32 stays float32, in IEEE precision).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n, n_ok = _tile_features(pid_n, N, BLOCK_N, SILU_MUL_OUT)
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    kk = tl.arange(0, BLOCK_K)
    k_first = split * k_iters * BLOCK_K
    h_end = K - pid_n * K  # the first feature block's programs store H (K for them, <= 0 for the rest)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = _dot_zeros(M_PAD, BLOCK_N, W_LEFT)
    sq = tl.zeros([M_PAD], tl.float32)
    first = 0
    if PDL:
        # As in _gemv_kernel: the first weight tile before the wait, x and the residual after it.
        w = _load_w(w_rows, k_first + kk, n_ok, K, EVEN)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc, sq = _norm_rows_fold(acc, sq, w, x_ptr, res_ptr, g_ptr, h_ptr, k_first + kk, m, m_ok, K, h_end,
                                  stride_xm, stride_rm, stride_hm, HAS_RES, IEEE, W_LEFT)
        first = 1
    for i in tl.range(first, k_iters, num_stages=NUM_STAGES):
        k = k_first + i * BLOCK_K + kk
        w = _load_w(w_rows, k, n_ok, K, EVEN)
        acc, sq = _norm_rows_fold(acc, sq, w, x_ptr, res_ptr, g_ptr, h_ptr, k, m, m_ok, K, h_end, stride_xm,
                                  stride_rm, stride_hm, HAS_RES, IEEE, W_LEFT)
    acc = _dot_rows(acc, W_LEFT)
    _store_norm_rows(acc, sq, m, n, n_ok, M, N, split, pid_n, part_ptr, sq_ptr, b_ptr, out_ptr, stride_om, k_f, eps,
                     M_PAD, BLOCK_N, SPLIT, HAS_BIAS, SILU_MUL_OUT, ACCURATE_EXP)


@triton.jit
def _norm_rows_reduce_kernel(part_ptr, sq_ptr, b_ptr, out_ptr, M, N, splits, stride_om, k_f, eps,
                             HAS_BIAS: tl.constexpr, SILU_MUL_OUT: tl.constexpr, ACCURATE_EXP: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    # SILU_MUL_OUT: the partials are cat(gate, up) (N wide), the output silu(gate) * up (N / 2 wide).
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = N // 2 if SILU_MUL_OUT else N
    ok = n < width
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    sq = tl.load(sq_ptr + row)
    for s in range(1, splits):  # split order: the same sum on every call
        sq += tl.load(sq_ptr + s * M + row)
    rstd = tl.math.rsqrt(tl.math.div_rn(sq, k_f) + eps)
    y = _norm_split_sum(part_ptr, b_ptr, row, n, ok, M, N, splits, rstd, HAS_BIAS).to(out_ptr.dtype.element_ty)
    if SILU_MUL_OUT:
        up = _norm_split_sum(part_ptr, b_ptr, row, width + n, ok, M, N, splits, rstd, HAS_BIAS)
        y = silu_mul_values(y, up.to(out_ptr.dtype.element_ty), ACCURATE_EXP)
    tl.store(out_ptr + row * stride_om + n, y, mask=ok)


@triton.jit
def _norm_split_sum(part_ptr, b_ptr, row, n, ok, M, N, splits, rstd, HAS_BIAS: tl.constexpr):
    """Features ``n`` of ``row``: the splits' partials summed in split order, scaled by ``rstd``, plus the bias."""
    acc = tl.load(part_ptr + row * N + n, mask=ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(part_ptr + (s * M + row) * N + n, mask=ok, other=0.0)
    acc = acc * rstd
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _row_of_x(x_ptr, row, k, M, K, stride_xm, SILU_MUL: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """Row ``row`` of ``x`` at columns ``k`` in float32, zeros for a row at or past ``M`` (none is
    read); ``SILU_MUL``: the row holds ``cat(gate, up)`` and the value is ``silu(gate) * up``."""
    ok = (k < K) & (tl.full(k.shape, row, tl.int32) < M)
    at = x_ptr + row * stride_xm + k
    x = tl.load(at, mask=ok, other=0.0)
    if SILU_MUL:
        x = silu_mul_values(x, tl.load(at + K, mask=ok, other=0.0), ACCURATE_EXP)
    return x.to(tl.float32)


@triton.jit
def _fold_four_rows(acc0, acc1, acc2, acc3, w, x_ptr, k, M, K, stride_xm, SILU_MUL: tl.constexpr,
                    ACCURATE_EXP: tl.constexpr):
    """One weight tile ``w`` ``[BLOCK_N, BLOCK_K]`` times rows 0..3 of ``x`` at columns ``k``, each
    into its own ``[BLOCK_N, BLOCK_K]`` float32 accumulator (the one-row kernel's product, four times)."""
    w = w.to(tl.float32)
    acc0 += w * _row_of_x(x_ptr, 0, k, M, K, stride_xm, SILU_MUL, ACCURATE_EXP)[None, :]
    acc1 += w * _row_of_x(x_ptr, 1, k, M, K, stride_xm, SILU_MUL, ACCURATE_EXP)[None, :]
    acc2 += w * _row_of_x(x_ptr, 2, k, M, K, stride_xm, SILU_MUL, ACCURATE_EXP)[None, :]
    acc3 += w * _row_of_x(x_ptr, 3, k, M, K, stride_xm, SILU_MUL, ACCURATE_EXP)[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit
def _stack_four_rows(s0, s1, s2, s3, m):
    """``[4, BLOCK_N]``: row ``i`` is ``si`` (``m`` is ``arange(0, 4)``), chosen, not added."""
    m = m[:, None]
    return tl.where(m == 0, s0[None, :], tl.where(m == 1, s1[None, :], tl.where(m == 2, s2[None, :], s3[None, :])))


@triton.jit
def _few_rows_tile(w_ptr, N, K, stride_wn, k_iters, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SILU_MUL_OUT: tl.constexpr):
    """The few-rows kernels' program: its weight rows ``n`` (and ``n_ok``; :func:`_tile_features`), split,
    rows ``m`` (``arange(0, 4)``), tile columns ``kk``, first column ``k_first``, ``h_end`` (the norm
    kernel's: the first feature block's programs store ``h``, ``K`` for them and ``<= 0`` for the rest),
    weight row pointers ``w_rows``, and four zero ``[BLOCK_N, BLOCK_K]`` float32 accumulators."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n, n_ok = _tile_features(pid_n, N, BLOCK_N, SILU_MUL_OUT)
    m = tl.arange(0, 4)
    kk = tl.arange(0, BLOCK_K)
    k_first = split * k_iters * BLOCK_K
    h_end = K - pid_n * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    zeros = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    return pid_n, split, n, n_ok, m, kk, k_first, h_end, w_rows, zeros, zeros, zeros, zeros


@triton.jit
def _few_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_iters,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, SILU_MUL: tl.constexpr,
                     SILU_MUL_OUT: tl.constexpr, ACCURATE_EXP: tl.constexpr, PDL: tl.constexpr):
    # Two to four rows: _gemv_kernel's one-row product for each row of x (rows past M are zeros,
    # never read), one weight tile feeding four accumulators; no tl.dot and no padding to 16 rows.
    (pid_n, split, n, n_ok, m, kk, k_first, _, w_rows,
     acc0, acc1, acc2, acc3) = _few_rows_tile(w_ptr, N, K, stride_wn, k_iters, BLOCK_N, BLOCK_K, SILU_MUL_OUT)
    first = 0
    if PDL:
        # As in _gemv_kernel: the first weight tile before the wait, x after it.
        w = _load_w(w_rows, k_first + kk, n_ok, K, EVEN)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc0, acc1, acc2, acc3 = _fold_four_rows(acc0, acc1, acc2, acc3, w, x_ptr, k_first + kk, M, K, stride_xm,
                                                 SILU_MUL, ACCURATE_EXP)
        first = 1
    for i in tl.range(first, k_iters, num_stages=NUM_STAGES):
        k = k_first + i * BLOCK_K + kk
        w = _load_w(w_rows, k, n_ok, K, EVEN)
        acc0, acc1, acc2, acc3 = _fold_four_rows(acc0, acc1, acc2, acc3, w, x_ptr, k, M, K, stride_xm, SILU_MUL,
                                                 ACCURATE_EXP)
    acc = _stack_four_rows(tl.sum(acc0, 1), tl.sum(acc1, 1), tl.sum(acc2, 1), tl.sum(acc3, 1), m)  # [4, BLOCK_N]
    m_ok = m < M
    if SPLIT:
        tl.store(part_ptr + (split * M + m[:, None]) * N + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        _store_out(acc, m, m_ok, n, n_ok, pid_n, N, b_ptr, out_ptr, stride_om, 4, BLOCK_N, HAS_BIAS, SILU_MUL_OUT,
                   ACCURATE_EXP)


@triton.jit
def _norm_row(x_ptr, res_ptr, h_ptr, g, row, k, M, K, h_end, stride_xm, stride_rm, stride_hm, HAS_RES: tl.constexpr):
    """Row ``row`` of ``h = x + residual`` (rounded to the dtype; ``x`` without a residual) at columns
    ``k`` in float32, stored to ``h`` by the first feature block's programs; and ``h * g``."""
    ok = (k < K) & (tl.full(k.shape, row, tl.int32) < M)
    x = tl.load(x_ptr + row * stride_xm + k, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_rm + k, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * stride_hm + k, x, mask=ok & (k < h_end))
    h = x.to(tl.float32)
    return h, h * g


@triton.jit
def _norm_fold_four_rows(acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, x_ptr, res_ptr, g_ptr, h_ptr, k, M, K,
                         h_end, stride_xm, stride_rm, stride_hm, EVEN: tl.constexpr, HAS_RES: tl.constexpr):
    """:func:`_norm_fold` for rows 0..3: their squares into ``sq0..sq3``, ``w * (h * g)`` into ``acc0..acc3``."""
    if EVEN:
        g = tl.load(g_ptr + k).to(tl.float32)
    else:
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    w = w.to(tl.float32)
    h, a = _norm_row(x_ptr, res_ptr, h_ptr, g, 0, k, M, K, h_end, stride_xm, stride_rm, stride_hm, HAS_RES)
    acc0 += w * a[None, :]
    sq0 += h * h
    h, a = _norm_row(x_ptr, res_ptr, h_ptr, g, 1, k, M, K, h_end, stride_xm, stride_rm, stride_hm, HAS_RES)
    acc1 += w * a[None, :]
    sq1 += h * h
    h, a = _norm_row(x_ptr, res_ptr, h_ptr, g, 2, k, M, K, h_end, stride_xm, stride_rm, stride_hm, HAS_RES)
    acc2 += w * a[None, :]
    sq2 += h * h
    h, a = _norm_row(x_ptr, res_ptr, h_ptr, g, 3, k, M, K, h_end, stride_xm, stride_rm, stride_hm, HAS_RES)
    acc3 += w * a[None, :]
    sq3 += h * h
    return acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3


@triton.jit
def _norm_few_rows_kernel(x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, h_ptr, part_ptr, sq_ptr, M, N, K, stride_xm,
                          stride_rm, stride_hm, stride_om, stride_wn, k_iters, k_f, eps, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, HAS_RES: tl.constexpr,
                          HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, SILU_MUL_OUT: tl.constexpr,
                          ACCURATE_EXP: tl.constexpr, PDL: tl.constexpr):
    # Two to four rows: _norm_gemv_kernel's product for each row (the normed row never rounded to
    # the dtype), one weight tile feeding four accumulators, each row's rstd from its own squares.
    (pid_n, split, n, n_ok, m, kk, k_first, h_end, w_rows,
     acc0, acc1, acc2, acc3) = _few_rows_tile(w_ptr, N, K, stride_wn, k_iters, BLOCK_N, BLOCK_K, SILU_MUL_OUT)
    sq0 = tl.zeros([BLOCK_K], tl.float32)
    sq1 = tl.zeros([BLOCK_K], tl.float32)
    sq2 = tl.zeros([BLOCK_K], tl.float32)
    sq3 = tl.zeros([BLOCK_K], tl.float32)
    first = 0
    if PDL:
        # As in _norm_gemv_kernel: the first weight tile before the wait, x and the residual after it.
        w = _load_w(w_rows, k_first + kk, n_ok, K, EVEN)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _norm_fold_four_rows(
            acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, x_ptr, res_ptr, g_ptr, h_ptr, k_first + kk, M, K, h_end,
            stride_xm, stride_rm, stride_hm, EVEN, HAS_RES)
        first = 1
    for i in tl.range(first, k_iters, num_stages=NUM_STAGES):
        k = k_first + i * BLOCK_K + kk
        w = _load_w(w_rows, k, n_ok, K, EVEN)
        acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _norm_fold_four_rows(
            acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, x_ptr, res_ptr, g_ptr, h_ptr, k, M, K, h_end, stride_xm,
            stride_rm, stride_hm, EVEN, HAS_RES)
    acc = _stack_four_rows(tl.sum(acc0, 1), tl.sum(acc1, 1), tl.sum(acc2, 1), tl.sum(acc3, 1), m)  # [4, BLOCK_N]
    sq = tl.where(m == 0, tl.sum(sq0, 0), tl.where(m == 1, tl.sum(sq1, 0), tl.where(m == 2, tl.sum(sq2, 0),
                                                                                     tl.sum(sq3, 0))))  # [4]
    _store_norm_rows(acc, sq, m, n, n_ok, M, N, split, pid_n, part_ptr, sq_ptr, b_ptr, out_ptr, stride_om, k_f, eps, 4,
                     BLOCK_N, SPLIT, HAS_BIAS, SILU_MUL_OUT, ACCURATE_EXP)


INTERPRETED = isinstance(_gemv_kernel, InterpretedFunction)
"""Whether this import got Triton's interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: no parallel hardware to fill


@dataclass(frozen=True)
class GemvLaunch:
    """Tile sizes and grid of one call (from the shape, dtype and SM count only)."""

    m_pad: int  # rows of x per program: 1 or FEW_ROWS (elementwise products), or 16, 32 or 64 (tl.dot)
    block_n: int  # output features per program
    block_k: int  # contraction elements per tile
    splits: int  # programs along K per feature block (1: no reduction kernel)
    k_iters: int  # BLOCK_K tiles per split
    num_warps: int
    num_stages: int  # software pipeline depth of the K loop (cp.async; 1: plain register loads)
    w_left: bool = False  # tl.dot paths: the weight tile is the product's left operand (ROWS_WEIGHTS_LEFT)


def plan_gemv(m: int, n: int, k: int, *, device: torch.device | str, splits: int | None = None,
              element_size: int = 2) -> GemvLaunch:
    """How :func:`linear` launches for ``x [m, k]`` and ``W [n, k]``.

    One row: ``[16, 256]`` weight tiles (``ONE_ROW_TILE``; 4 warps: four 16-byte loads a thread a
    tile, 32 float32 accumulators a thread) in 3 pipeline stages (17 KiB of shared memory and 78
    registers a thread on sm_90: six programs fit an SM). Two to ``FEW_ROWS`` (4) rows: the same
    product for each row on ``[8, 256]`` tiles (``FEW_ROWS_TILE``), 4 warps, 3 stages. More rows:
    ``[64, 128]`` tiles (``ROWS_TILE``) in a ``tl.dot`` with ``m`` rows padded to 16, 32 or 64, the
    weight tile as its left operand (``ROWS_WEIGHTS_LEFT``), 4 warps (``ROWS_WARPS``: no value of the
    three kernels spills to local memory at 16 to 64 rows), 3 stages for 16-bit weights, 2 for
    float32 (``element_size`` 4). ``splits`` (default: 1 when the feature
    blocks reach the path's programs per SM, ``ONE_ROW_PROGRAMS_PER_SM``, ``FEW_ROWS_PROGRAMS_PER_SM``
    or ``ROWS_PROGRAMS_PER_SM``, else the fewest splits
    that get there, preferring a divisor of the tile count so every split reads whole tiles without
    masks; at most ``MAX_SPLITS`` and one split per tile) cuts ``k`` into equal runs of whole tiles.
    """
    target = _sm_count(torch.device(device))
    if m == 1:
        block_n, block_k = ONE_ROW_TILE
        m_pad, num_stages, num_warps = 1, ONE_ROW_STAGES, 4
        target *= ONE_ROW_PROGRAMS_PER_SM
    elif m <= FEW_ROWS:
        block_n, block_k = FEW_ROWS_TILE
        m_pad, num_stages, num_warps = FEW_ROWS, FEW_ROWS_STAGES, 4
        target *= FEW_ROWS_PROGRAMS_PER_SM
    else:
        block_n, block_k = ROWS_TILE
        m_pad, num_stages = max(16, 1 << (m - 1).bit_length()), ROWS_STAGES if element_size <= 2 else 2
        num_warps = ROWS_WARPS
        target *= ROWS_PROGRAMS_PER_SM
    tiles = triton.cdiv(k, block_k)
    blocks = triton.cdiv(n, block_n)
    if splits is None:
        splits = 1
        if blocks < target:
            want = min(triton.cdiv(target, blocks), MAX_SPLITS, tiles)
            even = [d for d in range(want, min(MAX_SPLITS, tiles) + 1) if tiles % d == 0]
            splits = even[0] if even else want
    elif not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits!r}")
    splits = max(1, min(splits, tiles))
    k_iters = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, k_iters)  # no split without a tile
    return GemvLaunch(m_pad=m_pad, block_n=block_n, block_k=block_k, splits=splits, k_iters=k_iters,
                      num_warps=num_warps, num_stages=num_stages, w_left=m_pad > FEW_ROWS and ROWS_WEIGHTS_LEFT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           splits: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for few rows, accumulated in float32.

    Parameters
    ----------
    x : ``[M, K]``, ``1 <= M <= MAX_ROWS``, float32, float16 or bfloat16 (not under the
        interpreter, whose ``tl.dot`` has no bfloat16); last dimension contiguous.
    weight : ``[N, K]`` in ``x``'s dtype and on its device, contiguous (``nn.Linear``'s layout).
    bias : ``[N]`` in ``x``'s dtype, or None.
    splits : K splits (default: :func:`plan_gemv`'s rule).

    Returns ``[M, N]`` in ``x``'s dtype: each output the float32 sum of its products (and the
    bias) rounded once. The same shape on the same device gives the same bits on every call; no
    host synchronization, capturable in a CUDA graph. ``ValueError`` for anything else.
    """
    return _linear(x, weight, bias, splits=splits, silu_mul=False, silu_mul_out=False)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    splits: int | None = None) -> torch.Tensor:
    """``fused_triton.silu_mul(linear(x, weight, bias))`` in one kernel: SwiGLU's gate/up projection
    with ``silu(gate) * up`` formed as its output is stored (the ``[M, 2 I]`` projection never is).

    ``weight`` is ``[2 I, K]`` (``cat(gate, up)``, the fused gate/up projection's rows) and ``bias``
    ``[2 I]`` or None; otherwise as :func:`linear`, whose launch it takes. Each program reads half a
    block of gate rows and the up rows of the same features, so it holds both values of each output.
    Returns ``[M, I]``: the bits of :func:`linear` followed by
    :func:`tpspec.model.fused_triton.silu_mul` (each projection rounded to the dtype first; a split
    launch's reduction forms it in the same order).
    """
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"weight must be cat(gate, up), an even number of rows, got {tuple(weight.shape)}")
    return _linear(x, weight, bias, splits=splits, silu_mul=False, silu_mul_out=True)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    splits: int | None = None) -> torch.Tensor:
    """``linear(fused_triton.silu_mul(gate_up), weight, bias)`` in one kernel: SwiGLU's down
    projection, ``silu(gate) * up`` formed as the K loop loads it (never stored).

    ``gate_up`` is ``[M, 2 K]`` (``cat(gate, up)``, the fused gate/up projection's output), ``weight``
    ``[N, K]``; otherwise as :func:`linear`. Each input element is the value
    :func:`tpspec.model.fused_triton.silu_mul` gives (``silu`` in float32 rounded to the dtype, the
    product rounded), so the result is that of ``silu_mul`` then :func:`linear`, bit for bit.
    """
    return _linear(gate_up, weight, bias, splits=splits, silu_mul=True, silu_mul_out=False)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, splits: int | None,
            silu_mul: bool, silu_mul_out: bool) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != (2 if silu_mul else 1) * weight.shape[1]:
        what = "gate_up must be [M, 2 K]" if silu_mul else "x must be [M, K]"
        raise ValueError(f"{what} and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m = x.shape[0]
    n, k = weight.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {m}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one of {DTYPES}, got {x.dtype}, {weight.dtype}"
                         + (f", {bias.dtype}" if bias is not None else ""))
    if INTERPRETED and x.dtype == torch.bfloat16:
        raise ValueError("Triton's interpreter has no bfloat16 tl.dot: run bfloat16 on CUDA")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("weight and bias must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n // 2 if silu_mul_out else n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    launch = plan_gemv(m, n, k, device=x.device, splits=splits, element_size=x.element_size())
    split = launch.splits > 1
    part = torch.empty((launch.splits, m, n), dtype=torch.float32, device=x.device) if split else out
    even = n % launch.block_n == 0 and k == launch.splits * launch.k_iters * launch.block_k
    bias_arg = bias if bias is not None else out  # not read without a bias
    pdl = pdl_args(x.device)
    grid = (triton.cdiv(n, launch.block_n), launch.splits)
    few_rows = launch.m_pad == FEW_ROWS
    counts = split_counters(x.device, grid[0]) if split and LAST_SPLIT_SUMS and not few_rows else None
    # FP fusion pinned on, as every GPU run compiled these kernels (Triton 3.10 turns its default off).
    if few_rows:
        _few_rows_kernel[grid](x, weight, bias_arg, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                               launch.k_iters, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN=even, SPLIT=split,
                               HAS_BIAS=bias is not None, NUM_STAGES=launch.num_stages, SILU_MUL=silu_mul,
                               SILU_MUL_OUT=silu_mul_out, ACCURATE_EXP=not INTERPRETED, num_warps=launch.num_warps,
                               num_stages=launch.num_stages, enable_fp_fusion=True, **pdl)
    else:
        _gemv_kernel[grid](x, weight, bias_arg, out, part, counts if counts is not None else part, m, n, k,
                           x.stride(0), weight.stride(0), out.stride(0), launch.k_iters, M_PAD=launch.m_pad,
                           BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, USE_DOT=launch.m_pad > 1, EVEN=even,
                           SPLIT=split, LAST_SUMS=counts is not None, HAS_BIAS=bias is not None,
                           IEEE=x.dtype == torch.float32, NUM_STAGES=launch.num_stages, SILU_MUL=silu_mul,
                           SILU_MUL_OUT=silu_mul_out, ACCURATE_EXP=not INTERPRETED, W_LEFT=launch.w_left,
                           num_warps=launch.num_warps, num_stages=launch.num_stages, enable_fp_fusion=True, **pdl)
    if split and counts is None:
        _reduce_kernel[(m, triton.cdiv(out.shape[1], REDUCE_BLOCK))](
            part, bias_arg, out, m, n, launch.splits, out.stride(0), HAS_BIAS=bias is not None,
            SILU_MUL_OUT=silu_mul_out, ACCURATE_EXP=not INTERPRETED, BLOCK=REDUCE_BLOCK, num_warps=4,
            enable_fp_fusion=True, **pdl)
    return out


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm and the linear after it in one pass over the weight, for up to ``MAX_ROWS`` rows.

    With ``h = x + residual`` rounded to the dtype (``x`` itself when ``residual`` is None), returns
    ``(y, h)``: ``y = (W (h * norm_weight)) * rsqrt(mean(h**2) + eps) + bias`` row by row, every sum in
    float32 and ``y`` rounded once to the dtype, and ``h``, a new tensor (``x`` itself without a
    residual). The K loop that streams ``W`` sums ``h**2`` as it goes; the programs of the first
    feature block store ``h``. One row is the norm of :func:`tpspec.model.fused_triton.rms_norm`
    followed by :func:`linear`, except that the normed row is never rounded to the dtype (two to
    ``FEW_ROWS`` rows likewise, each row on its own); more rows round ``h * norm_weight`` to the dtype
    for the tensor cores' ``tl.dot`` (float32: no rounding) and scale the product by each row's
    ``rsqrt`` after it.

    Parameters
    ----------
    x, residual : ``[M, K]``, ``1 <= M <= MAX_ROWS``, one dtype of :data:`DTYPES` (float32 or float16
        under the interpreter), last dimension contiguous; ``residual`` may be None.
    norm_weight : ``[K]`` in that dtype, contiguous.
    eps : the norm's epsilon.
    weight, bias : as for :func:`linear`.
    splits : K splits (default: :func:`plan_gemv`'s rule for ``M`` rows).

    Same bits on every call for one shape and device; no host synchronization, capturable in a CUDA
    graph. ``ValueError`` for anything else.
    """
    return _norm_linear(x, residual, norm_weight, eps, weight, bias, splits=splits, silu_mul_out=False)


def norm_linear_silu_mul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_linear` of SwiGLU's gate/up projection storing ``silu(gate) * up``, for 2 to
    ``MAX_ROWS`` rows: ``weight`` is ``[2 I, K]`` (``cat(gate, up)``), ``bias`` ``[2 I]`` or None.

    Returns ``(fused_triton.silu_mul(y), h)`` for ``(y, h) = norm_linear(...)``, bit for bit, the
    activation ``[M, I]`` (programs read gate rows and the up rows of the same features, as
    :func:`linear_silu_mul`). One row has no such kernel (its down projection takes ``silu`` inside,
    :func:`silu_mul_linear`): ``ValueError``, as for anything :func:`norm_linear` refuses.
    """
    if x.dim() == 2 and x.shape[0] == 1:
        raise ValueError("norm_linear_silu_mul takes 2 or more rows; one row: norm_linear, then silu_mul_linear")
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"weight must be cat(gate, up), an even number of rows, got {tuple(weight.shape)}")
    return _norm_linear(x, residual, norm_weight, eps, weight, bias, splits=splits, silu_mul_out=True)


def _norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, bias: torch.Tensor | None, *, splits: int | None,
                 silu_mul_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {m}")
    n = weight.shape[0]
    tensors = [x, weight, norm_weight] + [t for t in (residual, bias) if t is not None]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"x, residual, norm_weight, weight and bias must share one of {DTYPES}, got "
                         f"{[t.dtype for t in tensors]}")
    if INTERPRETED and x.dtype == torch.bfloat16:
        raise ValueError("Triton's interpreter runs these kernels in float32 and float16: run bfloat16 on CUDA")
    if residual is not None and tuple(residual.shape) != (m, k):
        raise ValueError(f"residual must be [{m}, {k}], got {tuple(residual.shape)}")
    if tuple(norm_weight.shape) != (k,) or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"norm_weight must be [{k}] and bias [{n}], got {tuple(norm_weight.shape)}"
                         + (f" and {tuple(bias.shape)}" if bias is not None else ""))
    if not weight.is_contiguous() or not norm_weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        raise ValueError("weight, norm_weight and bias must be contiguous")
    x = x.contiguous()
    h = torch.empty_like(x) if residual is not None else x
    res = residual.contiguous() if residual is not None else x  # not read without a residual
    out = torch.empty((m, n // 2 if silu_mul_out else n), dtype=x.dtype, device=x.device)
    if n == 0:
        if residual is not None:
            torch.add(x, residual, out=h)
        return out, h
    launch = plan_gemv(m, n, k, device=x.device, splits=splits, element_size=x.element_size())
    split = launch.splits > 1
    grid = (triton.cdiv(n, launch.block_n), launch.splits)
    part = torch.empty((launch.splits, m, n), dtype=torch.float32, device=x.device) if split else out
    even = n % launch.block_n == 0 and k == launch.splits * launch.k_iters * launch.block_k
    bias_arg = bias if bias is not None else out  # not read without a bias
    pdl = pdl_args(x.device)
    if m > 1:
        sq = torch.empty((launch.splits, m), dtype=torch.float32, device=x.device) if split else out
        rows_kernel = _norm_few_rows_kernel if launch.m_pad == FEW_ROWS else _norm_rows_kernel
        dot_args = {} if launch.m_pad == FEW_ROWS else dict(M_PAD=launch.m_pad, IEEE=x.dtype == torch.float32,
                                                            W_LEFT=launch.w_left)
        rows_kernel[grid](x, res, norm_weight, weight, bias_arg, out, h, part, sq, m, n, k, x.stride(0), res.stride(0),
                          h.stride(0), out.stride(0), weight.stride(0), launch.k_iters, float(k), float(eps),
                          BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN=even, SPLIT=split,
                          HAS_RES=residual is not None, HAS_BIAS=bias is not None, NUM_STAGES=launch.num_stages,
                          SILU_MUL_OUT=silu_mul_out, ACCURATE_EXP=not INTERPRETED, num_warps=launch.num_warps,
                          num_stages=launch.num_stages, enable_fp_fusion=True, **dot_args, **pdl)
        if split:
            _norm_rows_reduce_kernel[(m, triton.cdiv(out.shape[1], REDUCE_BLOCK))](
                part, sq, bias_arg, out, m, n, launch.splits, out.stride(0), float(k), float(eps),
                HAS_BIAS=bias is not None, SILU_MUL_OUT=silu_mul_out, ACCURATE_EXP=not INTERPRETED,
                BLOCK=REDUCE_BLOCK, num_warps=4, enable_fp_fusion=True, **pdl)
        return out, h
    assert not silu_mul_out, "one row has no norm kernel storing silu(gate) * up"
    counts = split_counters(x.device, grid[0]) if split and LAST_SPLIT_SUMS else None
    # The squares' split sums: block 0's ([splits]) for the reduction kernel, every block's for the last programs.
    sq = torch.empty((launch.splits, grid[0] if counts is not None else 1), dtype=torch.float32,
                     device=x.device) if split else out
    _norm_gemv_kernel[grid](x, res, norm_weight, weight, bias_arg, out, h, part, sq,
                            counts if counts is not None else sq, n, k, weight.stride(0), launch.k_iters, float(k),
                            float(eps), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN=even, SPLIT=split,
                            LAST_SUMS=counts is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
                            NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
                            num_stages=launch.num_stages, enable_fp_fusion=True, **pdl)
    if split and counts is None:
        _norm_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK),)](part, sq, bias_arg, out, n, launch.splits, float(k),
                                                              float(eps), HAS_BIAS=bias is not None,
                                                              BLOCK=REDUCE_BLOCK, num_warps=4,
                                                              enable_fp_fusion=True, **pdl)
    return out, h
