"""64-bit selection keys and counter-based Gumbel noise.

A *key* packs one candidate (value, global column) of a row into an int64 whose
signed order is the candidate order, so ``max`` over keys picks the winner on any
device and through any max-reduction (``torch.max``, an all-gather then ``max``, or
the LL kernel's unsigned 64-bit max on ``key ^ (1 << 63)``):

* high 32 bits: the value's float32 bits mapped to an order-preserving integer,
  after widening bf16/fp16 exactly, turning ``-0.0`` into ``+0.0`` and every NaN into
  the canonical positive NaN (which ranks above ``+inf``, like ``torch.argmax``);
* low 32 bits: ``0xFFFFFFFF - column``, so ties go to the lowest column.

Gumbel-max sampling draws ``argmax_j logit_j / T - ln(E_j)`` with ``E_j ~ Exp(1)``
built from a Philox4x32-10 word keyed by the row's 64-bit seed and a counter made
of the row's 64-bit offset and the **global** column ``j``. Everything after the
integer Philox word uses basic IEEE float32 operations in a fixed order (no library
``log``, no fused multiply-add), so the CPU, torch on CUDA and the NVRTC kernel give
identical bits. ``csrc/ll_exchange`` implements the same recipe; change both together.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from .validation import check_int

GREEDY_TEMPERATURE_THRESHOLD = 1e-5
"""Rows whose temperature is below this are greedy: no noise, no division."""

EMPTY_KEY = -(2**63)
"""A key below every real candidate (its high half would be a negative NaN, which
canonicalization never produces). Padding columns and empty slots use it."""

CANONICAL_NAN_BITS = 0x7FC00000
MASK32 = 0xFFFFFFFF
SUPPORTED_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Philox4x32-10 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10


# --------------------------------------------------------------------------- keys

def canonical_float32(values: torch.Tensor) -> torch.Tensor:
    """Widen to float32 exactly, map ``-0.0`` to ``+0.0`` and every NaN to the canonical NaN."""
    if values.dtype not in SUPPORTED_VALUE_DTYPES:
        raise ValueError(f"values must be float32, bfloat16 or float16, got {values.dtype}")
    x = values.to(torch.float32)
    x = torch.where(x == 0, torch.zeros_like(x), x)  # -0.0 == 0 is True: both become +0.0
    # torch.full, not torch.tensor: a device fill, no host copy (allowed inside CUDA graph capture).
    nan = torch.full((), CANONICAL_NAN_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    return torch.where(torch.isnan(x), nan, x)


def ordered_high_bits(values: torch.Tensor) -> torch.Tensor:
    """Map canonical float32 values to int64 in ``[-2**31, 2**31)`` preserving order."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    # Negative floats order backwards: flip their 31 magnitude bits (sign stays set).
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def pack_keys(values: torch.Tensor, indices: torch.Tensor | int) -> torch.Tensor:
    """Pack candidates into int64 keys whose signed order is the candidate order.

    ``values``: float32/bf16/fp16 tensor; ``indices``: non-negative global columns
    (int tensor broadcastable to ``values`` or a Python int), each below ``2**32``.
    Returns an int64 tensor of the broadcast shape. ``torch.max`` over the keys of a
    row picks what ``torch.argmax`` picks on the row: the largest value, the first NaN,
    ties to the lowest index, ``-0.0 == +0.0``. A Python int index out of range raises
    ``ValueError``; tensor indices are data and are not checked (no device sync).
    """
    high = ordered_high_bits(canonical_float32(values))
    if not isinstance(indices, torch.Tensor):
        check_int("index", indices, low=0, below=2**32)
        indices = torch.full((), indices, dtype=torch.int64, device=high.device)
    low = MASK32 - indices.to(torch.int64)
    return (high << 32) | low


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_keys`: ``(values float32, indices int64)``.

    Values come back canonical (``+0.0`` for zeros, the canonical NaN for NaNs).
    """
    if keys.dtype != torch.int64:
        raise ValueError(f"keys must be int64, got {keys.dtype}")
    high = keys >> 32
    low = keys & MASK32
    bits = torch.where(high < 0, high ^ 0x7FFFFFFF, high)
    values = bits.to(torch.int32).view(torch.float32)
    return values, MASK32 - low


def unpack_indices(keys: torch.Tensor) -> torch.Tensor:
    """Only the global column of each key (int64)."""
    return MASK32 - (keys & MASK32)


# ------------------------------------------------------------------------- philox

def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``a * m`` for uint32 values held in int64.

    The multiplier is split into 16-bit halves so no intermediate exceeds 2**49:
    integer-exact on every device, no reliance on signed overflow.
    """
    m_hi, m_lo = m >> 16, m & 0xFFFF
    t = a * m_lo
    u = a * m_hi
    lo = (((u & 0xFFFF) << 16) + t) & MASK32
    hi = (u + (t >> 16)) >> 16
    return hi, lo


def philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 block function on uint32 words stored in int64 tensors (broadcasting).

    Stateless and integer-exact: the same words on CPU and GPU, equal to the Random123
    reference (see the known-answer test).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_words(
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    columns: torch.Tensor,
    column_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The 32-bit random word ``h`` of each (row, global column), as int64 in ``[0, 2**32)``.

    ``seeds``/``offsets``: ``[R]`` int64 (any 64-bit pattern); ``columns``: ``[C]`` int64
    global columns. Returns ``[R, C]``. Column ``j`` reads word ``j & 3`` of the Philox
    block whose counter is ``(j >> 2 low, j >> 2 high, offset low, offset high)`` and
    whose key is ``(seed low, seed high)``. ``column_range``: ``(min, max)`` of ``columns``
    when the caller knows them (no device sync: allowed inside CUDA graph capture).
    """
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    offsets = offsets.to(torch.int64).reshape(-1, 1)
    columns = columns.to(torch.int64).reshape(1, -1)
    if columns.numel() == 0:
        return torch.zeros(seeds.shape[0], 0, dtype=torch.int64, device=seeds.device)
    lo, hi = column_range if column_range is not None else (int(columns.min()), int(columns.max()))
    first_block = lo >> 2
    last_block = hi >> 2
    blocks = torch.arange(first_block, last_block + 1, dtype=torch.int64, device=columns.device).reshape(1, -1)
    words = philox4x32_10(
        (blocks & MASK32, (blocks >> 32) & MASK32, offsets & MASK32, (offsets >> 32) & MASK32),
        (seeds & MASK32, (seeds >> 32) & MASK32),
    )
    # [R, B, 4] -> [R, 4B]: position (b - first_block) * 4 + w holds column 4b + w.
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(seeds.shape[0], -1)
    return stacked[:, (columns.reshape(-1) - first_block * 4)]


# ------------------------------------------------------------ portable arithmetic

def _f32(value: float, device: torch.device) -> torch.Tensor:
    """A float32 constant as a 0-dim device tensor (never a CPU scalar: torch may turn
    division by a CPU scalar into multiplication by its reciprocal on some devices). A device
    fill, not a host copy, so it is allowed inside CUDA graph capture."""
    return torch.full((), value, dtype=torch.float32, device=device)


# Float32 constants, written as the exact decimal of their bits. The CUDA kernel uses
# the same bit patterns.
_INV_ODD = {  # 1/3, 1/5, ... rounded to float32
    3: 0.3333333432674408,
    5: 0.20000000298023224,
    7: 0.1428571492433548,
    9: 0.1111111119389534,
    11: 0.09090909361839294,
    13: 0.07692307978868484,
}
_LN2_HI = 0.693145751953125  # 0x3F317200: few mantissa bits, so e * LN2_HI is exact
_LN2_LO = 1.4286068203094172e-06  # 0x35BFBE8E
_SQRT2_BITS = 0x3FB504F3  # float32(sqrt(2))
_TWO_POW_M32 = 2.3283064365386963e-10  # 2**-32, exact


def portable_log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive, finite, normal float32 values, bit-identical on every device.

    ``x = m * 2**e`` with ``m`` in ``[sqrt(1/2), sqrt(2)]``; ``ln m = 2 atanh(s)``,
    ``s = (m - 1) / (m + 1)``, by its odd series to ``s**9``; then ``e * ln 2`` added
    in two parts. Relative error below 2e-7.
    """
    dev = x.device
    bits = x.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa_bits = (bits & 0x007FFFFF) | 0x3F800000
    big = mantissa_bits > _SQRT2_BITS
    m = mantissa_bits.view(torch.float32)
    m = torch.where(big, m * _f32(0.5, dev), m)
    e = (exponent + big.to(torch.int32)).to(torch.float32)
    one = _f32(1.0, dev)
    s = (m - one) / (m + one)
    z = s * s
    p = z * _f32(_INV_ODD[9], dev)
    p = p + _f32(_INV_ODD[7], dev)
    p = p * z
    p = p + _f32(_INV_ODD[5], dev)
    p = p * z
    p = p + _f32(_INV_ODD[3], dev)
    p = p * z
    p = p + one
    t = s * p
    t = t + t
    low = e * _f32(_LN2_LO, dev)
    low = low + t
    high = e * _f32(_LN2_HI, dev)
    return high + low


def exponential_from_words(words: torch.Tensor) -> torch.Tensor:
    """``E = -ln(1 - U) ~ Exp(1)`` from 32-bit words ``h``, ``U = (h + 0.5) * 2**-32``, float32.

    For ``U < 1/2`` the series ``2 atanh(U / (2 - U))`` to ``s**13`` (accurate where
    ``1 - U`` would round away the small values that decide the winners); for
    ``U >= 1/2`` ``-ln`` of the complement ``(~h + 0.5) * 2**-32``, rounded once and
    never zero. Relative error below 1e-6 everywhere.
    """
    dev = words.device
    scale = _f32(_TWO_POW_M32, dev)
    upper = words >= 2**31
    # Round (h + 0.5) once to float32: exact in float64 first, then one rounding.
    u = (words.to(torch.float64) + 0.5).to(torch.float32) * scale
    complement = ((MASK32 - words).to(torch.float64) + 0.5).to(torch.float32) * scale
    # Series branch, U < 1/2 (the value on upper rows is computed and discarded).
    u_small = torch.where(upper, torch.zeros_like(u), u)
    s = u_small / (_f32(2.0, dev) - u_small)
    z = s * s
    p = z * _f32(_INV_ODD[13], dev)
    p = p + _f32(_INV_ODD[11], dev)
    for k in (9, 7, 5, 3):
        p = p * z
        p = p + _f32(_INV_ODD[k], dev)
    p = p * z
    p = p + _f32(1.0, dev)
    series = s * p
    series = series + series
    # Log branch, U >= 1/2: complement in (0, 1/2], exact-rounded and positive.
    safe_complement = torch.where(upper, complement, torch.ones_like(complement))
    log_branch = -portable_log(safe_complement)
    return torch.where(upper, log_branch, series)


def gumbel_scores(
    logits: torch.Tensor,
    columns: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    column_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Float32 scores ``logit / T - ln(E)`` whose row argmax is an exact softmax(logit/T) draw.

    ``logits``: ``[R, C]`` (any supported dtype); ``columns``: ``[C]`` global columns;
    ``temperature``, ``seeds``, ``offsets``: ``[R]``. NaN logits stay NaN.
    ``column_range``: see :func:`philox_words`.
    """
    x = canonical_float32(logits)
    e = exponential_from_words(philox_words(seeds, offsets, columns, column_range))
    log_e = portable_log(e)
    scaled = x / temperature.to(torch.float32).reshape(-1, 1)
    return scaled - log_e


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise ``-ln(E)`` of each (row, global column): ``[R, C]`` float32."""
    return -portable_log(exponential_from_words(philox_words(seeds, offsets, columns)))


# ------------------------------------------------------------ masses (filters)

MASS_BITS = 40
"""A column's mass is ``floor(exp(s - m) * 2**MASS_BITS)``: the row's best column has exactly
``2**40``, and a row of up to ``2**22`` columns sums below ``2**63``."""
TOP_P_BITS = 24
"""``top_p`` is rounded to ``TOP_P_BITS`` fractional bits before its exact integer product."""

_INV_LN2 = 1.4426950216293335  # 0x3FB8AA3B
_EXP_COEFFS = (  # 1/7!, 1/6!, ..., 1/2! rounded to float32 (Horner order)
    0.00019841270113829523,  # 0x39500D01
    0.0013888889225199819,  # 0x3AB60B61
    0.008333333767950535,  # 0x3C088889
    0.0416666679084301,  # 0x3D2AAAAB
    0.1666666716337204,  # 0x3E2AAAAB
    0.5,
)
_EXP_FLOOR = -64.0  # exp(-64) * 2**40 < 1e-15: every mass below it is 0; keeps 2**k normal


def portable_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` of float32 ``x <= 0``, bit-identical on every device (basic IEEE float32
    operations in a fixed order, no fused multiply-add, no library ``exp``).

    ``x`` is clamped to ``[-64, 0]`` (``-inf`` gives ``exp(-64)``; NaN stays NaN); ``k =
    floor(x / ln 2 + 1/2)``, ``r = (x - k ln2_hi) - k ln2_lo`` in ``[-0.35, 0.35]``, ``exp(r)`` by
    its Taylor series to ``r**7`` in Horner form, times ``2**k`` built from its bits. ``exp(0)``
    is exactly 1. Relative error below 3e-7.
    """
    dev = x.device
    x = torch.clamp(x.to(torch.float32), min=_EXP_FLOOR, max=0.0)
    k = torch.floor(x * _f32(_INV_LN2, dev) + _f32(0.5, dev))
    r = x - k * _f32(_LN2_HI, dev)
    r = r - k * _f32(_LN2_LO, dev)
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r
        p = p + _f32(c, dev)
    one = _f32(1.0, dev)
    p = p * r
    p = p + one
    p = p * r
    p = p + one
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * scale


def column_masses(scores: torch.Tensor, max_score: torch.Tensor) -> torch.Tensor:
    """Int64 masses ``floor(exp(s - m) * 2**40)`` of float32 ``scores`` ``[R, C]`` under each
    row's finite max score ``max_score`` ``[R]`` (``s - m`` and ``exp`` in the portable
    arithmetic). A score of ``-inf`` has mass 0; rows whose max is not finite get 0 everywhere
    (their draw is their best column, see ``docs/determinism.md``).
    """
    m = max_score.to(torch.float32).reshape(-1, 1)
    finite = torch.isfinite(m)
    d = scores.to(torch.float32) - torch.where(finite, m, torch.zeros_like(m))
    d = torch.where(finite & ~torch.isnan(d), d, torch.full_like(d, float("-inf")))
    e = portable_exp(d) * _f32(float(2**MASS_BITS), scores.device)
    return e.to(torch.int64)


def top_p_fixed(top_p: torch.Tensor) -> torch.Tensor:
    """``round(top_p * 2**24)`` as int64 (``top_p`` float32 in ``[0, 1]``; the product is exact,
    the rounding is half to even)."""
    return torch.round(top_p.to(torch.float64) * float(2**TOP_P_BITS)).to(torch.int64)


def top_p_target(total: torch.Tensor, top_p_bits: torch.Tensor) -> torch.Tensor:
    """``ceil(P * Z / 2**24)`` in exact int64 arithmetic: the mass a top-p prefix must reach.

    ``total`` ``Z`` (int64, ``< 2**62``) and ``top_p_bits`` ``P`` (int64 in ``[0, 2**24]``, from
    :func:`top_p_fixed`); ``Z`` is split at bit 24 so no product exceeds ``2**62``.
    """
    shift = TOP_P_BITS
    high, low = total >> shift, total & ((1 << shift) - 1)
    return top_p_bits * high + ((top_p_bits * low + ((1 << shift) - 1)) >> shift)


def min_p_threshold(min_p: torch.Tensor) -> torch.Tensor:
    """``floor(min_p * 2**40)`` as int64 (``min_p`` float32 in ``[0, 1]``): the least mass a
    column keeps under min-p (the best column has ``2**40``)."""
    return (min_p.to(torch.float32) * _f32(float(2**MASS_BITS), min_p.device)).to(torch.int64)


def philox_words_at(seeds: torch.Tensor, offsets: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The Philox word of each (row, column) for per-row columns: ``columns`` ``[R, K]`` int64
    global columns (``seeds``/``offsets`` ``[R]``) -> ``[R, K]``, equal to
    :func:`philox_words` at those columns (one Philox block per element: for a few columns
    scattered over the vocabulary)."""
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    offsets = offsets.to(torch.int64).reshape(-1, 1)
    columns = columns.to(torch.int64)
    blocks = columns >> 2
    words = philox4x32_10(
        (blocks & MASK32, (blocks >> 32) & MASK32, offsets & MASK32, (offsets >> 32) & MASK32),
        (seeds & MASK32, (seeds >> 32) & MASK32),
    )
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    return stacked.gather(-1, (columns & 3).unsqueeze(-1)).squeeze(-1)


def gumbel_scores_at(scores: torch.Tensor, columns: torch.Tensor, seeds: torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
    """Gumbel scores ``s - ln(E)`` of per-row columns: ``scores`` ``[R, K]`` float32 (already
    divided by T), ``columns`` ``[R, K]`` global columns. Bit for bit what
    :func:`gumbel_scores` gives at those columns."""
    log_e = portable_log(exponential_from_words(philox_words_at(seeds, offsets, columns)))
    return scores.to(torch.float32) - log_e


# ------------------------------------------------------------------ sampling rows

class PenaltyStep(Protocol):
    """What :attr:`SamplingRows.penalties` holds (``tpspec.sampling.penalties.RowPenalties``, or
    ``tpspec.sampling.controls.RowControls``: logit bias, penalties and token masks):
    ``apply(logits slice [R, C], vocab_offset) -> processed slice [R, C]``, applied by each rank
    to its own columns before any selection."""

    def apply(self, local_logits: torch.Tensor, vocab_offset: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplingRows:
    """How each row of one selection is drawn: per-row ``[R]`` tensors on the logits' device.

    The one object every layer passes (keys, exchanges, the sharded logits, selection):

    * ``temperature``: ``[R]`` float; rows below ``greedy_threshold`` take the argmax
      (no noise, no division), the others a Gumbel-max draw from ``softmax(logits / T)``.
    * ``seeds`` / ``offsets``: ``[R]`` int64 Philox streams (any 64-bit pattern), or both
      None: the exchange's step counter then seeds the rows.
    * ``top_k`` (``[R]`` int64; ``>= vocab`` or INT32_MAX = off), ``top_p`` (``[R]`` float32;
      1 = off), ``min_p`` (``[R]`` float32; 0 = off): the filters, None = off for every row.
      The exchanges draw unfiltered rows only; ``tpspec.sampling.select`` applies filters.
    * ``penalties``: None, or the step's logits processing (a :class:`PenaltyStep`: penalties,
      and with logit controls a bias and token masks) that
      ``tpspec.sampling.select.select_tokens`` applies to each rank's raw logits slice
      before the draw (the exchanges never apply it).
    * ``is_all_greedy``: a batch fact that chooses code paths; it must be
      equal on every rank of the group (``SpecMetadata`` syncs them under attention DP), and
      so must be which filters are None.
    """

    temperature: torch.Tensor
    seeds: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    greedy_threshold: float = GREEDY_TEMPERATURE_THRESHOLD
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    penalties: PenaltyStep | None = None
    is_all_greedy: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def has_filters(self) -> bool:
        """True when some row may carry a top-k, top-p or min-p filter."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def temperature_only(self) -> bool:
        """True when no row has a filter: a plain Gumbel-max (or greedy) draw of the (penalised) logits."""
        return not self.has_filters


# ------------------------------------------------------------- local row reduction

def local_row_keys(
    logits: torch.Tensor,
    vocab_offset: int,
    *,
    vocab_size: int | None = None,
    rows: SamplingRows | None = None,
) -> torch.Tensor:
    """Reduce a rank's ``[R, C]`` logits slice to one winning key per row (``[R]`` int64).

    Column ``c`` of the slice is global column ``vocab_offset + c``; columns at or past
    ``vocab_size`` are never chosen (a row with no real column gets :data:`EMPTY_KEY`).
    Without ``rows`` every row ranks the logits themselves; with ``rows``, rows whose
    temperature is below ``rows.greedy_threshold`` do, the others rank Gumbel scores from
    ``(rows.seeds, rows.offsets)`` (which must be given here). Filters and penalties of
    ``rows`` are not applied. Inputs are assumed validated (see ``tpspec.exchange.base``).
    """
    num_rows, width = logits.shape
    device = logits.device
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    real_width = width if vocab_size is None else max(0, min(width, vocab_size - vocab_offset))
    if real_width == 0:
        return torch.full((num_rows,), EMPTY_KEY, dtype=torch.int64, device=device)
    logits = logits[:, :real_width]
    columns = torch.arange(vocab_offset, vocab_offset + real_width, dtype=torch.int64, device=device)
    values = canonical_float32(logits)
    if rows is not None:
        temperature = rows.temperature.to(torch.float32)
        sampled = temperature >= rows.greedy_threshold
        safe_t = torch.where(sampled, temperature, torch.ones_like(temperature))
        scores = gumbel_scores(logits, columns, safe_t, rows.seeds, rows.offsets,
                               column_range=(vocab_offset, vocab_offset + real_width - 1))
        values = torch.where(sampled.reshape(-1, 1), canonical_float32(scores), values)
    keys = pack_keys(values, columns.reshape(1, -1))
    return keys.max(dim=1).values


# ------------------------------------------------- bounds of the noise, for pruning

# The CUDA kernel ranks a sampled row's columns first by a cheap estimate of the score,
# ``t + G[bucket(h)]`` with ``t = logit * (1 / T)`` and ``G`` a table of the noise
# ``-ln E`` over buckets of the Philox word ``h``, and computes the exact portable score
# only for columns whose estimate comes within the error bound of the best lower bound.
# The exact score of every column that can win is still the portable one, so the tokens
# do not change; the table only decides which columns are worth the exact arithmetic.
# The bucket of h: fold the upper half onto the lower one (c = h or ~h), then take the
# position of c's leading one and the GUMBEL_BUCKET_SUB_BITS bits after it.

GUMBEL_BUCKET_SUB_BITS = 3
GUMBEL_BUCKETS_PER_HALF = 33 << GUMBEL_BUCKET_SUB_BITS
GUMBEL_BOUND_ABS_ERROR = 1e-3
"""Bound on ``|exact score - (t + true noise)|`` is ``ABS + REL * |t|`` (the exact path's
roundings are below ``2**-21 |t| + 1e-5``; the rest is slack for the bound arithmetic)."""
GUMBEL_BOUND_REL_ERROR = 2.0**-16


def gumbel_bucket_index(words: torch.Tensor) -> torch.Tensor:
    """Bucket of each 32-bit Philox word (int64 tensor in ``[0, 2**32)``), as the kernel computes it.

    ``c = h`` below ``2**31``, else ``~h``; ``lz`` = leading zeros of ``c`` as a 32-bit word
    (32 for 0); ``sub`` = the ``GUMBEL_BUCKET_SUB_BITS`` bits after ``c``'s leading one.
    Index ``= (h >> 31) * GUMBEL_BUCKETS_PER_HALF + (lz << SUB_BITS) + sub``.
    """
    words = words.to(torch.int64)
    half = words >> 31
    c = torch.where(half == 1, MASK32 - words, words)
    lz = torch.full_like(c, 32)
    for bit in range(31, -1, -1):  # the highest set bit decides; c < 2**31 so bit 31 never is
        lz = torch.where((c >> bit) == 1, torch.full_like(c, 31 - bit), lz)
    norm = torch.where(c == 0, torch.zeros_like(c), (c << lz.clamp(max=31)) & MASK32)
    sub = (norm >> (31 - GUMBEL_BUCKET_SUB_BITS)) & ((1 << GUMBEL_BUCKET_SUB_BITS) - 1)
    return half * GUMBEL_BUCKETS_PER_HALF + (lz << GUMBEL_BUCKET_SUB_BITS) + sub


def _true_noise(h: int) -> float:
    """``-ln E`` of word ``h`` in float64 (E = -ln(1 - U), U = (h + 0.5) 2**-32)."""
    u = (h + 0.5) * 2.0**-32
    return -math.log(-math.log1p(-u))


def _bucket_word_range(index: int) -> tuple[int, int]:
    """The smallest and largest word ``h`` of bucket ``index`` (empty buckets: ``(-1, -1)``)."""
    sub_bits = GUMBEL_BUCKET_SUB_BITS
    half, rest = divmod(index, GUMBEL_BUCKETS_PER_HALF)
    lz, sub = rest >> sub_bits, rest & ((1 << sub_bits) - 1)
    if lz == 0:
        return -1, -1  # c < 2**31: never used
    if lz == 32:
        lo = hi = 0 if sub == 0 else -1
    else:
        top = 31 - lz  # position of c's leading one
        if top >= sub_bits:
            step = 1 << (top - sub_bits)
            lo = (1 << top) + sub * step
            hi = lo + step - 1
        else:  # few bits: each c its own bucket (sub holds the bits shifted up)
            shift = sub_bits - top
            lo = hi = (1 << top) + (sub >> shift) if sub & ((1 << shift) - 1) == 0 else -1
    if lo < 0:
        return -1, -1
    if half == 1:
        lo, hi = MASK32 - hi, MASK32 - lo
    return lo, hi


@functools.lru_cache(maxsize=None)
def gumbel_bound_constants() -> tuple[tuple[float, ...], float, float, float]:
    """``(G, half_width, noise_max, noise_min)`` of the pruning bound, in float64.

    ``G[b]`` (to be rounded to float32) is the midpoint of the true noise over bucket
    ``b``, ``half_width`` bounds ``|true noise - float32(G[b])|`` for every word of the
    bucket, and ``noise_max`` / ``noise_min`` bound the noise of any word. The noise is
    monotone in ``h``, so each bucket's extremes sit at its end words.
    """
    mids = []
    half_width = 0.0
    for index in range(2 * GUMBEL_BUCKETS_PER_HALF):
        lo, hi = _bucket_word_range(index)
        if lo < 0:
            mids.append(0.0)
            continue
        g_top, g_bottom = _true_noise(lo), _true_noise(hi)  # decreasing in h
        mid = 0.5 * (g_top + g_bottom)
        mid32 = float(torch.tensor(mid, dtype=torch.float32))
        half_width = max(half_width, g_top - mid32, mid32 - g_bottom)
        mids.append(mid32)
    return tuple(mids), half_width + 1e-6, _true_noise(0) + 1e-6, _true_noise(MASK32) - 1e-6


def gumbel_bound_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 table the CUDA kernel prunes with: ``2 * GUMBEL_BUCKETS_PER_HALF``
    bucket midpoints, then ``C0 = half_width + ABS + 24 * REL`` (the error bound of an
    estimate ``A`` is ``C0 + REL * |A|``), ``noise_max`` and ``noise_min`` (rounded
    outward), and one zero of padding."""
    mids, half_width, noise_max, noise_min = gumbel_bound_constants()
    c0 = half_width + GUMBEL_BOUND_ABS_ERROR + 24.0 * GUMBEL_BOUND_REL_ERROR
    tail = [c0 * (1 + 2**-20), noise_max + 1e-5, noise_min - 1e-5, 0.0]
    return torch.tensor(list(mids) + tail, dtype=torch.float32, device=device)
