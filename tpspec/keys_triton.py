"""Triton kernels of the key arithmetic of :mod:`tpspec.keys`, bit for bit.

The selection tail of a step reads every column of its logits rows a few times: scores to keys,
the best keys of each row, the masses of a row. In torch each is a chain of full-width kernels
over int64 tensors; here each is one kernel. Every value equals the torch function's bit for bit:
the integer arithmetic is exact, and the float32 arithmetic is the same sequence of basic IEEE
operations (``enable_fp_fusion=False``: no fused multiply-add; division through ``div_rn``, the
correctly rounded one), the recipe ``tpspec.keys`` fixes for every device.

* :func:`score_keys`: a rank's ``[R, W]`` logits slice (optionally divided by per-row
  temperatures, as ``tpspec.sampling.ops.scaled_scores``) to keys (``pack_keys``; columns at or
  past the vocabulary: ``EMPTY_KEY``) and the best key of every :data:`KEY_BLOCK` columns.
* :func:`row_argmax`: the argmax of whole logits rows (``torch.argmax``'s pick), the best key of
  every :data:`ARGMAX_BLOCK` columns first, then of each row.
* :func:`top_keys`: a row's ``count`` best keys, best first (``torch.topk``'s values), read from
  the ``count`` blocks whose best keys are the largest: the row's ``count``-th key is at least the
  ``count``-th largest block maximum, so every key above it lies in those blocks.
* :func:`row_masses_and_counts`: per row, the exact int64 sum of the masses
  ``floor(exp(s - m) * 2**40)`` (``keys.column_masses``) and the number of columns whose value is
  at least a threshold (what logprobs need beside the best keys).

The ``@triton.jit`` helpers (:func:`portable_exp`, :func:`portable_log`,
:func:`exponential_from_words`, :func:`philox_word`, :func:`pack`, :func:`store_score_keys`) are the
same functions for kernels of the layers above.

This module imports ``triton``. Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton``
is imported) runs the same kernels on CPU tensors, which is how the CPU tests check them
(:data:`INTERPRETED` says which mode this import got). Launches depend only on shapes, never on
values, and allocate only outputs of those shapes: a CUDA graph can capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import keys as K

KEY_BLOCK = 128
"""Columns per block whose best key :func:`score_keys` records."""
_PROGRAM_COLUMNS = 1024  # columns one score_keys program handles (KEY_BLOCK divides it)
_SUM_COLUMNS = 1024  # columns one row_masses_and_counts program handles
ARGMAX_BLOCK = 2048
"""Columns per program of :func:`row_argmax`'s first launch."""

# tpspec.keys' float32 constants (each rounds to the same float32 in a kernel), as the constexprs a
# jit function may read.
_INV_LN2 = tl.constexpr(K._INV_LN2)
_LN2_HI = tl.constexpr(K._LN2_HI)
_LN2_LO = tl.constexpr(K._LN2_LO)
_C7, _C6, _C5, _C4, _C3, _C2 = (tl.constexpr(c) for c in K._EXP_COEFFS)
_INV3, _INV5, _INV7, _INV9, _INV11, _INV13 = (tl.constexpr(K._INV_ODD[k]) for k in (3, 5, 7, 9, 11, 13))
_TWO_POW_M32 = tl.constexpr(K._TWO_POW_M32)
_MASS_SCALE = tl.constexpr(float(2**K.MASS_BITS))


# ------------------------------------------------------------------ jit helpers

@triton.jit
def empty_keys(like):
    """``EMPTY_KEY`` in the shape of ``like``."""
    return tl.full(like.shape, -9223372036854775808, tl.int64)


@triton.jit
def canonical(x):
    """float32 ``x`` with ``-0.0`` as ``+0.0`` and every NaN as the canonical NaN (``keys.canonical_float32``)."""
    x = tl.where(x == 0.0, 0.0, x)
    nan = tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(x != x, nan, x)


@triton.jit
def pack(x, columns):
    """Keys of canonical float32 ``x`` at int64 global ``columns`` (``keys.pack_keys``)."""
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    high = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (high << 32) | (tl.full(columns.shape, 4294967295, tl.int64) - columns)


@triton.jit
def key_values(keys):
    """The float32 values of int64 ``keys`` (``keys.unpack_keys``' first half)."""
    high = keys >> 32
    bits = tl.where(high < 0, high ^ 0x7FFFFFFF, high)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def key_columns(keys):
    """The global columns of int64 ``keys`` (``keys.unpack_indices``)."""
    return tl.full(keys.shape, 4294967295, tl.int64) - (keys & 4294967295)


@triton.jit
def portable_exp(x):
    """``keys.portable_exp``: float32 ``exp(x)`` for ``x <= 0``, clamped to ``[-64, 0]``."""
    x = tl.minimum(tl.maximum(x, -64.0, propagate_nan=tl.PropagateNan.ALL), 0.0, propagate_nan=tl.PropagateNan.ALL)
    k = tl.floor(x * _INV_LN2 + 0.5)
    r = x - k * _LN2_HI
    r = r - k * _LN2_LO
    p = tl.full(r.shape, _C7, tl.float32)
    p = p * r
    p = p + _C6
    p = p * r
    p = p + _C5
    p = p * r
    p = p + _C4
    p = p * r
    p = p + _C3
    p = p * r
    p = p + _C2
    p = p * r
    p = p + 1.0
    p = p * r
    p = p + 1.0
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def column_masses(scores, best):
    """``keys.column_masses``: int64 ``floor(exp(s - m) * 2**40)`` of float32 ``scores`` under the
    row's max score ``best`` (broadcastable); 0 everywhere when ``best`` is not finite."""
    finite = tl.abs(best) < float("inf")  # False for NaN too
    d = scores - tl.where(finite, best, 0.0)
    d = tl.where(finite, tl.where(d == d, d, float("-inf")), float("-inf"))
    return (portable_exp(d) * _MASS_SCALE).to(tl.int64)


@triton.jit
def _twice_atanh(s, z, p):
    """``2 atanh(s)`` by its odd series in ``z = s * s``, ``p`` its Horner sum down to the ``1/7`` term:
    the ``1/5``, ``1/3`` and ``1`` terms, times ``2 s`` (the tail ``keys.portable_log`` and
    ``keys.exponential_from_words`` share)."""
    p = p * z
    p = p + _INV5
    p = p * z
    p = p + _INV3
    p = p * z
    p = p + 1.0
    t = s * p
    return t + t


@triton.jit
def portable_log(x):
    """``keys.portable_log``: natural log of positive, finite, normal float32 values."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa_bits = (bits & 0x007FFFFF) | 0x3F800000
    big = mantissa_bits > 0x3FB504F3
    m = mantissa_bits.to(tl.float32, bitcast=True)
    m = tl.where(big, m * 0.5, m)
    e = (exponent + big.to(tl.int32)).to(tl.float32)
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    z = s * s
    p = z * _INV9
    p = p + _INV7
    t = _twice_atanh(s, z, p)
    low = e * _LN2_LO
    low = low + t
    high = e * _LN2_HI
    return high + low


@triton.jit
def exponential_from_words(words):
    """``keys.exponential_from_words``: float32 ``E ~ Exp(1)`` from int64 words in ``[0, 2**32)``."""
    upper = words >= 2147483648
    u = (words.to(tl.float64) + 0.5).to(tl.float32) * _TWO_POW_M32
    complement = ((tl.full(words.shape, 4294967295, tl.int64) - words).to(tl.float64) + 0.5).to(tl.float32)
    complement = complement * _TWO_POW_M32
    u_small = tl.where(upper, 0.0, u)
    s = tl.math.div_rn(u_small, 2.0 - u_small)
    z = s * s
    p = z * _INV13
    p = p + _INV11
    p = p * z
    p = p + _INV9
    p = p * z
    p = p + _INV7
    series = _twice_atanh(s, z, p)
    safe_complement = tl.where(upper, complement, 1.0)
    log_branch = -portable_log(safe_complement)
    return tl.where(upper, log_branch, series)


@triton.jit
def philox_word(seeds, offsets, columns):
    """``keys.philox_words``: the 32-bit Philox4x32-10 word (as int64) of each (seed, offset,
    global column), all int64 and broadcastable."""
    blocks = columns >> 2
    c0 = blocks.to(tl.uint32)
    c1 = (blocks >> 32).to(tl.uint32)
    c2 = offsets.to(tl.uint32)
    c3 = (offsets >> 32).to(tl.uint32)
    k0 = seeds.to(tl.uint32)
    k1 = (seeds >> 32).to(tl.uint32)
    for i in tl.static_range(10):
        if i > 0:
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    which = columns & 3
    word = tl.where(which == 0, c0, tl.where(which == 1, c1, tl.where(which == 2, c2, c3)))
    return word.to(tl.int64)


@triton.jit
def gumbel_at(scores, columns, seeds, offsets):
    """``keys.gumbel_scores_at``: ``s - ln(E)`` of float32 ``scores`` at int64 global ``columns``."""
    return scores - portable_log(exponential_from_words(philox_word(seeds, offsets, columns)))


# ------------------------------------------------------------------ kernels

@triton.jit
def _score_keys_kernel(x_ptr, t_ptr, keys_ptr, block_max_ptr, width, vocab_offset, vocab_size, stride_x, stride_k,
                       num_blocks, greedy_threshold, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                       KEY_BLOCK_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    store_score_keys(x, row, start, cols, inside, t_ptr, keys_ptr, block_max_ptr, vocab_offset, vocab_size, stride_k,
                     num_blocks, greedy_threshold, SCALE, BLOCK, KEY_BLOCK_)


@triton.jit
def store_score_keys(x, row, start, cols, inside, t_ptr, keys_ptr, block_max_ptr, vocab_offset, vocab_size, stride_k,
                     num_blocks, greedy_threshold, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                     KEY_BLOCK_: tl.constexpr):
    """:func:`score_keys` of one program's float32 values ``x`` (columns ``cols`` of ``row``, from
    ``start``): their keys (divided by the row's temperature with ``SCALE``) and their blocks' best keys."""
    x = canonical(x)
    if SCALE:
        t = tl.load(t_ptr + row).to(tl.float32)
        t = tl.where(t < greedy_threshold, 1.0, t)
        x = canonical(tl.math.div_rn(x, t))
    columns = (vocab_offset + cols).to(tl.int64)
    keys = tl.where(inside & (columns < vocab_size), pack(x, columns), empty_keys(columns))
    tl.store(keys_ptr + row * stride_k + cols, keys, mask=cols < num_blocks * KEY_BLOCK_)
    best = tl.max(tl.reshape(keys, (BLOCK // KEY_BLOCK_, KEY_BLOCK_)), axis=1)
    blocks = start // KEY_BLOCK_ + tl.arange(0, BLOCK // KEY_BLOCK_)
    tl.store(block_max_ptr + row * num_blocks + blocks, best, mask=blocks < num_blocks)


@triton.jit
def _row_sums_kernel(keys_ptr, best_ptr, high_ptr, mass_ptr, count_ptr, width, stride_k, num_programs,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + row * stride_k + cols, mask=cols < width, other=-9223372036854775808)
    real = keys != empty_keys(keys)
    best = tl.load(best_ptr + row)
    masses = tl.where(real, column_masses(key_values(keys), best), 0)
    at_least = real & ((keys >> 32) >= tl.load(high_ptr + row))
    tl.store(mass_ptr + row * num_programs + part, tl.sum(masses, axis=0))
    tl.store(count_ptr + row * num_programs + part, tl.sum(at_least.to(tl.int64), axis=0))


@triton.jit
def _block_best_kernel(x_ptr, best_ptr, width, vocab_offset, stride_x, num_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    x = canonical(tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32))
    keys = tl.where(inside, pack(x, (vocab_offset + cols).to(tl.int64)), empty_keys(cols.to(tl.int64)))
    tl.store(best_ptr + row * num_blocks + block, tl.max(keys, axis=0))


@triton.jit
def _best_column_kernel(best_ptr, out_ptr, num_blocks, BLOCKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCKS_PAD)
    keys = tl.load(best_ptr + row * num_blocks + b, mask=b < num_blocks, other=-9223372036854775808)
    tl.store(out_ptr + row, key_columns(tl.max(keys, axis=0)))


INTERPRETED = isinstance(_score_keys_kernel, InterpretedFunction)


# ------------------------------------------------------------------ wrappers

def key_blocks(width: int) -> int:
    """Blocks of :data:`KEY_BLOCK` columns that a ``width``-column slice spans."""
    return triton.cdiv(width, KEY_BLOCK)


def score_keys(local: torch.Tensor, vocab_offset: int, vocab_size: int,
               temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of a rank's logits slice and the best key of each block of :data:`KEY_BLOCK` columns.

    ``local``: ``[R, W]`` float32 / bfloat16 / float16 (its last dimension contiguous), global
    columns ``[vocab_offset, vocab_offset + W)``; ``temperature``: ``[R]`` or None. Returns
    ``(keys [R, B * KEY_BLOCK] int64, block_max [R, B] int64)``, ``B = key_blocks(W)``: column
    ``c < W`` holds ``pack_keys(s, vocab_offset + c)`` with ``s = canonical_float32(logit)``, or
    with a temperature ``tpspec.sampling.ops.scaled_scores`` (``s / T``, rows below the greedy
    threshold divided by 1); ``EMPTY_KEY`` at columns past ``vocab_size`` and past ``W``.
    """
    rows, width = local.shape
    if local.stride(1) != 1:
        local = local.contiguous()
    blocks = key_blocks(width)
    keys = torch.empty(rows, blocks * KEY_BLOCK, dtype=torch.int64, device=local.device)
    block_max = torch.empty(rows, blocks, dtype=torch.int64, device=local.device)
    if rows == 0 or width == 0:
        return keys, block_max
    t = temperature if temperature is not None else block_max  # unread without SCALE
    if temperature is not None:
        t = temperature.to(device=local.device, dtype=torch.float32).contiguous()
    grid = (rows, triton.cdiv(blocks * KEY_BLOCK, _PROGRAM_COLUMNS))
    _score_keys_kernel[grid](local, t, keys, block_max, width, vocab_offset, vocab_size, local.stride(0),
                             keys.stride(0), blocks, K.GREEDY_TEMPERATURE_THRESHOLD, SCALE=temperature is not None,
                             BLOCK=_PROGRAM_COLUMNS, KEY_BLOCK_=KEY_BLOCK, num_warps=4, enable_fp_fusion=False)
    return keys, block_max


def row_argmax(local: torch.Tensor, vocab_offset: int, width: int) -> torch.Tensor:
    """Greedy tokens of a whole logits row: ``[R]`` int64, ``vocab_offset + torch.argmax(local[:,
    :width], dim=1)`` (the largest value, the first NaN, ties to the lowest column, ``-0.0 ==
    +0.0``: the maximum of ``pack_keys``).

    ``local``: ``[R, >= width]`` float32 / bfloat16 / float16, its last dimension contiguous,
    ``width >= 1``. Two launches: the best key of every :data:`ARGMAX_BLOCK` columns, then each
    row's best (one program a row: a torch argmax of a few rows runs one program a row over the
    whole width)."""
    rows = local.shape[0]
    if local.stride(1) != 1:
        local = local.contiguous()
    blocks = triton.cdiv(width, ARGMAX_BLOCK)
    best = torch.empty(rows, blocks, dtype=torch.int64, device=local.device)
    out = torch.empty(rows, dtype=torch.int64, device=local.device)
    if rows == 0:
        return out
    _block_best_kernel[(rows, blocks)](local, best, width, vocab_offset, local.stride(0), blocks, BLOCK=ARGMAX_BLOCK,
                                       num_warps=4, enable_fp_fusion=False)
    _best_column_kernel[(rows,)](best, out, blocks, BLOCKS_PAD=triton.next_power_of_2(blocks), num_warps=4,
                                 enable_fp_fusion=False)
    return out


def top_keys(keys: torch.Tensor, block_max: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` best keys of every row, best first: ``[R, count]`` int64, equal to
    ``torch.topk(keys, count).values``. ``keys``/``block_max``: :func:`score_keys`' outputs; the
    row must have at least ``count`` blocks holding a real key (:func:`top_keys_apply` says
    whether the shapes guarantee it)."""
    rows, blocks = block_max.shape
    chosen = torch.topk(block_max, count, dim=1).indices
    spans = keys.view(rows, blocks, KEY_BLOCK).gather(1, chosen.unsqueeze(2).expand(-1, -1, KEY_BLOCK))
    return torch.topk(spans.reshape(rows, count * KEY_BLOCK), count, dim=1).values


def top_keys_apply(width: int, vocab_offset: int, vocab_size: int, count: int) -> bool:
    """Whether :func:`top_keys` serves a slice of ``width`` columns from ``vocab_offset``: at least
    ``count`` of its blocks start below ``vocab_size`` (each holds a real key), and it has more
    columns than ``count`` (else every key is a candidate)."""
    real = max(0, min(width, vocab_size - vocab_offset))
    return count < real and key_blocks(real) >= count


def row_masses_and_counts(keys: torch.Tensor, best: torch.Tensor, high: torch.Tensor,
                          width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``keys`` (``[R, >= width]`` int64, :func:`score_keys`' layout): the exact sum of
    the masses ``column_masses(value, best)`` of its real columns (``[R]`` int64; ``best``: ``[R]``
    float32 max scores) and the number of real columns whose key's high half is at least ``high``
    (``[R]`` int64)."""
    rows = keys.shape[0]
    parts = max(1, triton.cdiv(width, _SUM_COLUMNS))
    masses = torch.empty(rows, parts, dtype=torch.int64, device=keys.device)
    counts = torch.empty(rows, parts, dtype=torch.int64, device=keys.device)
    if rows == 0:
        return masses.sum(dim=1), counts.sum(dim=1)
    _row_sums_kernel[(rows, parts)](keys, best.to(torch.float32).contiguous(), high.to(torch.int64).contiguous(),
                                    masses, counts, width, keys.stride(0), parts, BLOCK=_SUM_COLUMNS, num_warps=4,
                                    enable_fp_fusion=False)
    return masses.sum(dim=1), counts.sum(dim=1)
