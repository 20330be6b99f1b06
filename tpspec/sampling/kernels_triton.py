"""Triton kernels of the sampling layer, bit for bit the torch functions they stand for.

* :func:`penalize`: repetition, presence and frequency penalties on a rank's slice
  (:func:`tpspec.sampling.penalties.apply_penalties` without drafts), one pass over the row, its
  occurrence counts and its prompt flags.
* :func:`penalized_keys`: the same penalties and then ``tpspec.keys_triton.score_keys`` in one pass:
  the keys of the penalised, temperature-scaled slice and their block maxima, without the float32
  penalised slice ever stored.
* :func:`count_tokens`: a step's emitted tokens added to the occurrence counts
  (:meth:`tpspec.sampling.penalties.OccurrenceCounts.add`), one program a row, integer atomics.
* :func:`draw_candidates`: the filtered draw from a row's gathered candidate keys
  (:func:`tpspec.sampling.select.draw_filtered` after the candidate exchange): the top-k, top-p and
  min-p cuts of ``tpspec.sampling.ops.sorted_filter_mask``, whether the candidates decide the row,
  and the Gumbel-max draw over the survivors, one program a row.
* :func:`draw_rows`: the same draw with each row's filters read from its own parameters and its
  final token given (the plain rows' draw where no filter is on): the torch launches around
  :func:`draw_candidates` in one kernel.

The float32 arithmetic is the torch functions' sequence of basic IEEE operations
(``enable_fp_fusion=False``, division through ``div_rn``); the rest is integer arithmetic. The
key arithmetic comes from :mod:`tpspec.keys_triton`, whose interpreter rule this module shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import keys as K
from .. import keys_triton

_PENALTY_COLUMNS = 1024  # columns one penalty program handles
_COUNT_BLOCK = 128  # tokens one counting program adds per loop iteration
MAX_CANDIDATES = 8192
"""The most candidate keys a row may bring to :func:`draw_candidates` (one program holds them)."""


@triton.jit
def _penalized_row(x_ptr, counts_ptr, seen_ptr, slot, rep_ptr, pres_ptr, freq_ptr, row, cols, inside, stride_x,
                   stride_table):
    """The penalised float32 values of ``cols`` of ``row``, whose occurrences are the tables' row
    ``slot`` (``apply_penalties``' operations, in its order)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    counts = tl.load(counts_ptr + slot * stride_table + cols, mask=inside, other=0)
    seen = tl.load(seen_ptr + slot * stride_table + cols, mask=inside, other=0) != 0
    r = tl.load(rep_ptr + row)
    p = tl.load(pres_ptr + row)
    f = tl.load(freq_ptr + row)
    in_output = counts > 0
    repeated = tl.where(x > 0, tl.math.div_rn(x, r), x * r)
    x = tl.where(in_output | seen, repeated, x)
    counted = (x - f * counts.to(tl.float32)) - p
    return tl.where(in_output, counted, x)


@triton.jit
def _penalties_kernel(x_ptr, counts_ptr, seen_ptr, slot_ptr, rep_ptr, pres_ptr, freq_ptr, out_ptr, width, stride_x,
                      stride_table, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    slot = tl.load(slot_ptr + row)
    x = _penalized_row(x_ptr, counts_ptr, seen_ptr, slot, rep_ptr, pres_ptr, freq_ptr, row, cols, inside,
                       stride_x, stride_table)
    tl.store(out_ptr + row * stride_o + cols, x, mask=inside)


@triton.jit
def _penalized_keys_kernel(x_ptr, counts_ptr, seen_ptr, slot_ptr, rep_ptr, pres_ptr, freq_ptr, t_ptr, keys_ptr,
                           block_max_ptr, width, vocab_offset, vocab_size, num_slots, stride_x, stride_table,
                           stride_k, num_blocks, greedy_threshold, BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    inside = cols < width
    slot = tl.load(slot_ptr + row)
    slot = tl.where((slot >= 0) & (slot < num_slots), slot, num_slots)  # no request: the sink row of zeros
    x = _penalized_row(x_ptr, counts_ptr, seen_ptr, slot, rep_ptr, pres_ptr, freq_ptr, row, cols, inside,
                       stride_x, stride_table)
    keys_triton.store_score_keys(x, row, start, cols, inside, t_ptr, keys_ptr, block_max_ptr, vocab_offset, vocab_size,
                                 stride_k, num_blocks, greedy_threshold, True, BLOCK, KEY_BLOCK)


@triton.jit
def _count_kernel(counts_ptr, slot_ptr, tokens_ptr, lengths_ptr, num_tokens, num_slots, vocab_offset, width,
                  stride_table, stride_t, HAS_LENGTHS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    counted = num_tokens
    if HAS_LENGTHS:
        counted = tl.minimum(tl.load(lengths_ptr + row), num_tokens)
    counted = tl.where((slot >= 0) & (slot < num_slots), counted, 0)  # a row of no slot counts nothing
    for start in range(0, counted, BLOCK):  # a resumed request brings its whole output at once
        j = start + tl.arange(0, BLOCK)
        tokens = tl.load(tokens_ptr + row * stride_t + j, mask=j < counted, other=-1)
        cols = tokens - vocab_offset
        ok = (j < counted) & (tokens >= 0) & (cols >= 0) & (cols < width)
        tl.atomic_add(counts_ptr + slot * stride_table + cols, tl.full([BLOCK], 1, tl.int32), mask=ok)


@triton.jit
def _top_p_target(total, bits):
    """``keys.top_p_target``: ``ceil(P * Z / 2**24)`` in exact int64 arithmetic."""
    return bits * (total >> 24) + ((bits * (total & 16777215) + 16777215) >> 24)


@triton.jit
def _round_half_even(x):
    """``torch.round`` of a non-negative float32 below ``2**24`` as int64 (exact: ``x - floor(x)`` is)."""
    whole = tl.floor(x)
    frac = x - whole
    up = (frac > 0.5) | ((frac == 0.5) & ((whole.to(tl.int64) & 1) == 1))
    return whole.to(tl.int64) + up.to(tl.int64)


@triton.jit
def _top_p_fixed(top_p):
    """``keys.top_p_fixed``: ``round(top_p * 2**24)``, half to even (the product is exact)."""
    return _round_half_even(top_p * 16777216.0)


@triton.jit
def _min_p_threshold(min_p):
    """``keys.min_p_threshold``: ``min_p * 2**40`` in float32 (exact), truncated to int64 as torch's cast."""
    return (min_p * 1099511627776.0).to(tl.int64)


@triton.jit
def _draw_row(ranked_ptr, floor_ptr, total_ptr, k_ptr, flags_ptr, p_bits_ptr, m_thr_ptr, seeds_ptr, offsets_ptr, row,
              n, vocab_size, greedy_threshold, RAW: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr,
              HAS_M: tl.constexpr, HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row's filtered draw from its candidates, as ``decide_and_draw``: ``(drawn, decided,
    filtered)``. Its filters come as ``draw_candidates`` computes them (``k_ptr``: the clamped top-k,
    ``flags_ptr``: on-flags, ``p_bits_ptr``, ``m_thr_ptr``: the fixed points) or, with ``RAW``, from
    the rows' own parameters: ``flags_ptr`` the temperatures, ``k_ptr`` the top-k (with ``HAS_K``),
    ``p_bits_ptr`` the top-p and ``m_thr_ptr`` the min-p (float32, with ``HAS_P`` / ``HAS_M``)."""
    j = tl.arange(0, BLOCK)
    keys = tl.load(ranked_ptr + row * n + j, mask=j < n, other=-9223372036854775808)
    empty = keys_triton.empty_keys(keys)
    real = keys != empty
    values = keys_triton.key_values(keys)
    best = keys_triton.key_values(tl.load(ranked_ptr + row * n))
    # Not degenerate (through int32: Triton's interpreter cannot mix a float compare's flag with a tensor's).
    finite = (tl.abs(best) < float("inf")).to(tl.int32) != 0
    masses = tl.where(real, keys_triton.column_masses(tl.where(real, values, 0.0), best), 0)
    if RAW:
        # _row_filters: a filter is on where its value says so and the row is sampled (float compares'
        # flags through int32, as above).
        sampled = (tl.load(flags_ptr + row) >= greedy_threshold).to(tl.int32) != 0
        k_on = sampled & False
        p_on = sampled & False
        m_on = sampled & False
        top_k = 1
        if HAS_K:
            top_k = tl.load(k_ptr + row)
            k_on = sampled & (top_k < vocab_size)
        if HAS_P:
            p_on = sampled & ((tl.load(p_bits_ptr + row) < 1.0).to(tl.int32) != 0)
        if HAS_M:
            m_on = sampled & ((tl.load(m_thr_ptr + row) > 0.0).to(tl.int32) != 0)
    else:
        flags = tl.load(flags_ptr + row)
        k_on = (flags & 1) != 0
        p_on = (flags & 2) != 0
        m_on = (flags & 4) != 0
    first = j == 0
    # sorted_filter_mask with top-k and top-p (and ``total`` on rows without top-k).
    if RAW:
        keep_k = tl.where(k_on, j < tl.maximum(top_k, 1), True)
    else:
        keep_k = tl.where(k_on, j < tl.load(k_ptr + row), True)
    kept_mass = tl.where(keep_k, masses, 0)
    z = tl.sum(kept_mass, axis=0)
    if HAS_TOTAL:
        total = tl.load(total_ptr + row)
        z = tl.where(k_on, z, total)
    if RAW:
        p_bits = 0
        if HAS_P:
            p_bits = _top_p_fixed(tl.load(p_bits_ptr + row))
    else:
        p_bits = tl.load(p_bits_ptr + row)
    before = tl.cumsum(kept_mass, axis=0) - kept_mass
    keep_kp = keep_k & tl.where(p_on, before < _top_p_target(z, p_bits), True)
    keep_kp = tl.where(first, True, keep_kp & real & finite)
    # sorted_filter_mask with min-p alone.
    if RAW:
        m_thr = 0
        if HAS_M:
            m_thr = _min_p_threshold(tl.load(m_thr_ptr + row))
    else:
        m_thr = tl.load(m_thr_ptr + row)
    keep_m = tl.where(first, True, tl.where(m_on, masses >= m_thr, True) & real & finite)
    keep = keep_kp & keep_m
    # Which rows the candidates decide (every input is equal on every rank).
    kept = tl.sum(keep_kp.to(tl.int64), axis=0)
    last_kept = tl.max(tl.where(j == kept - 1, keys, empty), axis=0)
    floor = tl.load(floor_ptr + row)
    if HAS_TOTAL:
        reached = tl.sum(tl.where(keep_kp & real, masses, 0), axis=0) >= _top_p_target(total, p_bits)
        p_decided = p_on & reached & (last_kept >= floor)
    else:
        p_decided = p_on & False
    floor_mass = keys_triton.column_masses(keys_triton.key_values(floor), best)
    floor_mass = tl.where(floor == -9223372036854775808, -1, floor_mass)
    only_m = m_on & (k_on == 0) & (p_on == 0)
    decided = (finite == 0) | k_on | p_decided | (only_m & (floor_mass < m_thr))
    # Gumbel-max over the survivors (the noise is keyed by global column: no exchange).
    columns = tl.where(real, keys_triton.key_columns(keys), 0)
    noisy = keys_triton.gumbel_at(values, columns, tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))
    winner = tl.max(tl.where(keep & real, keys_triton.pack(keys_triton.canonical(noisy), columns), empty), axis=0)
    return 4294967295 - (winner & 4294967295), decided, k_on | p_on | m_on


@triton.jit
def _candidate_draw_kernel(ranked_ptr, floor_ptr, total_ptr, k_ptr, flags_ptr, p_bits_ptr, m_thr_ptr, seeds_ptr,
                           offsets_ptr, drawn_ptr, decided_ptr, n, HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    drawn, decided, _ = _draw_row(ranked_ptr, floor_ptr, total_ptr, k_ptr, flags_ptr, p_bits_ptr, m_thr_ptr,
                                  seeds_ptr, offsets_ptr, row, n, 0, 0.0, False, True, True, True, HAS_TOTAL, BLOCK)
    tl.store(drawn_ptr + row, drawn)
    tl.store(decided_ptr + row, decided.to(tl.int8))


@triton.jit
def _row_draw_kernel(ranked_ptr, floor_ptr, total_ptr, t_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr,
                     offsets_ptr, plain_ptr, tokens_ptr, decided_ptr, n, vocab_size, greedy_threshold,
                     HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_M: tl.constexpr, HAS_PLAIN: tl.constexpr,
                     HAS_TOTAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    drawn, decided, filtered = _draw_row(ranked_ptr, floor_ptr, total_ptr, top_k_ptr, t_ptr, top_p_ptr, min_p_ptr,
                                         seeds_ptr, offsets_ptr, row, n, vocab_size, greedy_threshold, True, HAS_K,
                                         HAS_P, HAS_M, HAS_TOTAL, BLOCK)
    # draw_filtered's last step: unfiltered rows are decided and take the plain draw (or 0).
    decided = decided | (filtered == 0)
    if HAS_PLAIN:
        token = tl.where(filtered, drawn, tl.load(plain_ptr + row))
    else:
        token = tl.where(filtered, drawn, 0)
    tl.store(tokens_ptr + row, tl.where(decided, token, 0))
    tl.store(decided_ptr + row, decided.to(tl.int8))


# ------------------------------------------------------------------ wrappers

def penalize(local: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, slot_index: torch.Tensor,
             repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Penalised float32 logits of a slice: ``[R, W]`` -> ``[R, W]``, what
    ``apply_penalties(..., drafts=None)`` returns.

    ``counts`` ``[S, >= W]`` int32 and ``seen`` ``[S, >= W]`` bool: the occurrence tables (rows
    the same stride apart); ``slot_index`` ``[R]`` int64: each row's table row (a sink row of
    zeros for rows without a request); ``repetition``/``presence``/``frequency``: ``[R]``.
    """
    rows, width = local.shape
    if local.stride(1) != 1:
        local = local.contiguous()
    out = torch.empty(rows, width, dtype=torch.float32, device=local.device)
    if rows == 0 or width == 0:
        return out
    if counts.stride() != seen.stride() or counts.stride(1) != 1:
        raise ValueError("the occurrence tables must share one row-major layout")
    dev = local.device

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=torch.float32).contiguous()

    grid = (rows, triton.cdiv(width, _PENALTY_COLUMNS))
    _penalties_kernel[grid](local, counts, seen.view(torch.uint8), slot_index.to(dev, torch.int64).contiguous(),
                            per_row(repetition), per_row(presence), per_row(frequency), out, width, local.stride(0),
                            counts.stride(0), out.stride(0), BLOCK=_PENALTY_COLUMNS, num_warps=4,
                            enable_fp_fusion=False)
    return out


def penalized_keys(local: torch.Tensor, vocab_offset: int, vocab_size: int, temperature: torch.Tensor,
                   counts: torch.Tensor, seen: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                   presence: torch.Tensor, frequency: torch.Tensor, *,
                   num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys_triton.score_keys(penalize(local, ...), vocab_offset, vocab_size, temperature)`` in one
    pass: ``(keys [R, B * KEY_BLOCK] int64, block_max [R, B] int64)``, the same bits.

    ``local`` ``[R, W]`` float32 / bfloat16 / float16 (its last dimension contiguous), global columns
    ``[vocab_offset, vocab_offset + W)``; ``temperature`` ``[R]``; the occurrence tables and per-row
    penalties as :func:`penalize` takes them, but ``slots`` ``[R]`` the rows' own slots: a slot
    outside ``[0, num_slots)`` (no request) reads the tables' row ``num_slots``, the sink row of
    zeros. The penalised float32 slice is never stored.
    """
    rows, width = local.shape
    if local.stride(1) != 1:
        local = local.contiguous()
    blocks = keys_triton.key_blocks(width)
    block = keys_triton.KEY_BLOCK
    keys = torch.empty(rows, blocks * block, dtype=torch.int64, device=local.device)
    block_max = torch.empty(rows, blocks, dtype=torch.int64, device=local.device)
    if rows == 0 or width == 0:
        return keys, block_max
    if counts.stride() != seen.stride() or counts.stride(1) != 1:
        raise ValueError("the occurrence tables must share one row-major layout")
    if counts.shape[0] <= num_slots or counts.shape[1] < width:
        raise ValueError(f"the tables [{counts.shape[0]}, {counts.shape[1]}] need the sink row {num_slots} and "
                         f"{width} columns")
    dev = local.device

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=torch.float32).contiguous()

    grid = (rows, triton.cdiv(blocks * block, _PENALTY_COLUMNS))
    _penalized_keys_kernel[grid](local, counts, seen.view(torch.uint8), slots.to(dev, torch.int64).contiguous(),
                                 per_row(repetition), per_row(presence), per_row(frequency), per_row(temperature),
                                 keys, block_max, width, vocab_offset, vocab_size, num_slots, local.stride(0),
                                 counts.stride(0), keys.stride(0), blocks, K.GREEDY_TEMPERATURE_THRESHOLD,
                                 BLOCK=_PENALTY_COLUMNS, KEY_BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return keys, block_max


def count_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                 lengths: torch.Tensor | None = None, *, num_slots: int, vocab_offset: int, width: int) -> None:
    """Adds one to ``counts[slot, token - vocab_offset]`` for every token of ``tokens`` ``[N, T]``
    (int64; negative = padding) of row ``n`` whose slot ``slots[n]`` is in ``[0, num_slots)`` and
    whose column is in ``[0, width)`` (with ``lengths`` ``[N]``: among the row's first
    ``lengths[n]`` tokens); everything else is skipped. ``counts``: ``[>= num_slots, >= width]``
    int32, its last dimension contiguous. Integer atomics: the same counts whatever the order the
    programs run in; no host synchronization."""
    rows, num_tokens = tokens.shape
    if rows == 0 or num_tokens == 0:
        return
    if counts.dtype != torch.int32 or counts.stride(1) != 1:
        raise ValueError("the counts must be an int32 table with contiguous rows")
    if counts.shape[0] < num_slots or counts.shape[1] < width:
        raise ValueError(f"the counts [{counts.shape[0]}, {counts.shape[1]}] do not hold {num_slots} slots of "
                         f"{width} columns")
    dev = counts.device
    tokens = tokens.to(dev, torch.int64).contiguous()
    has_lengths = lengths is not None
    lengths = lengths.to(dev, torch.int64).contiguous() if has_lengths else tokens
    _count_kernel[(rows,)](counts, slots.to(dev, torch.int64).contiguous(), tokens, lengths, num_tokens,
                           num_slots, vocab_offset, width, counts.stride(0), num_tokens, HAS_LENGTHS=has_lengths,
                           BLOCK=min(_COUNT_BLOCK, max(16, triton.next_power_of_2(num_tokens))), num_warps=1)


def _draw_outputs(ranked: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[R]`` int64 tokens and int8 verdicts a draw of ``ranked`` ``[R, N]`` writes; ``ValueError``
    unless a row brings 1 to ``MAX_CANDIDATES`` candidates (any count when there is no row)."""
    rows, n = ranked.shape
    if rows and not 0 < n <= MAX_CANDIDATES:
        raise ValueError(f"{name} takes 1 to {MAX_CANDIDATES} candidates a row, got {n}")
    return (torch.empty(rows, dtype=torch.int64, device=ranked.device),
            torch.empty(rows, dtype=torch.int8, device=ranked.device))


def draw_rows(ranked: torch.Tensor, floor: torch.Tensor, total: torch.Tensor | None, temperature: torch.Tensor,
              top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None, seeds: torch.Tensor,
              offsets: torch.Tensor, plain: torch.Tensor | None, *, vocab_size: int,
              greedy_threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered draw of every row from its candidates, its filters read from the rows' own
    parameters, and each row's final token: ``(tokens [R] int64, decided [R] bool)``, what
    ``tpspec.sampling.select.draw_filtered`` returns for a plan without min-p-only rows.

    ``ranked``/``floor``/``total``/``seeds``/``offsets``: as :func:`draw_candidates`;
    ``temperature`` ``[R]`` float32 (rows below ``greedy_threshold`` are not sampled, so no filter
    is on for them); ``top_k`` int64, ``top_p`` and ``min_p`` float32 ``[R]`` or None (off for every
    row); ``plain`` ``[R]`` int64: the exchange's draw of the rows without a filter (None: no such
    row). A filtered row takes its draw where the candidates decide it, token 0 where they do not;
    a row without a filter takes ``plain`` and is decided.
    """
    rows, n = ranked.shape
    dev = ranked.device
    tokens, decided = _draw_outputs(ranked, "draw_rows")
    if rows == 0:
        return tokens, decided.bool()

    def arg(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return floor if t is None else t.to(dev, dtype).contiguous()  # None: never read

    _row_draw_kernel[(rows,)](
        ranked.contiguous(), floor.contiguous(), arg(total, torch.int64), arg(temperature, torch.float32),
        arg(top_k, torch.int64), arg(top_p, torch.float32), arg(min_p, torch.float32), arg(seeds, torch.int64),
        arg(offsets, torch.int64), arg(plain, torch.int64), tokens, decided, n, vocab_size, greedy_threshold,
        HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_M=min_p is not None, HAS_PLAIN=plain is not None,
        HAS_TOTAL=total is not None, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=4, enable_fp_fusion=False)
    return tokens, decided.bool()


def draw_candidates(ranked: torch.Tensor, floor: torch.Tensor, total: torch.Tensor | None, top_k: torch.Tensor,
                    k_on: torch.Tensor, p_on: torch.Tensor, m_on: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, seeds: torch.Tensor,
                    offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered draw of every row from its candidates: ``(drawn [R] int64, decided [R] bool)``.

    ``ranked`` ``[R, N]``: every rank's candidate keys, best first (``EMPTY_KEY`` pads), ``N <=
    MAX_CANDIDATES``; ``floor`` ``[R]``: the largest of the ranks' last sent keys; ``total`` ``[R]``
    int64: the rows' exact mass sums (None: no row needs it); ``top_k``/``top_p``/``min_p`` and
    ``k_on``/``p_on``/``m_on``: ``[R]``. ``drawn`` is the Gumbel-max (``seeds``, ``offsets``) over
    the candidates that survive ``sorted_filter_mask``'s top-k and top-p cut and its min-p cut;
    ``decided`` is True where the candidates decide the row (a finite best score and top-k, a
    certified top-p prefix, or a min-p row whose threshold lies above every unsent column), before
    the masked min-p draw.
    """
    rows, n = ranked.shape
    dev = ranked.device
    drawn, decided = _draw_outputs(ranked, "draw_candidates")
    if rows == 0:
        return drawn, decided.bool()
    flags = (k_on.to(dev, torch.int32) + 2 * p_on.to(dev, torch.int32) + 4 * m_on.to(dev, torch.int32)).contiguous()
    k = top_k.to(dev, torch.int64).clamp(min=1).contiguous()
    p_bits = K.top_p_fixed(top_p.to(dev)).contiguous()
    m_thr = K.min_p_threshold(min_p.to(dev)).contiguous()
    has_total = total is not None
    _candidate_draw_kernel[(rows,)](
        ranked.contiguous(), floor.contiguous(), total.contiguous() if has_total else floor, k, flags, p_bits, m_thr,
        seeds.to(dev, torch.int64).contiguous(), offsets.to(dev, torch.int64).contiguous(), drawn, decided, n,
        HAS_TOTAL=has_total, BLOCK=max(16, triton.next_power_of_2(n)), num_warps=4, enable_fp_fusion=False)
    return drawn, decided.bool()
