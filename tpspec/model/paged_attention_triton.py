"""Paged attention in Triton: decode, verification and prefill chunks over the paged KV cache.

Every step shape runs the same kernel, ``_attend_kernel``. Its programs are
``(query block, KV head, KV split)``:

* **Query block.** Up to ``BLOCK_Q`` consecutive query rows of one sequence. Together with the
  ``GROUP`` query heads of one KV head they form the ``BLOCK_M = BLOCK_Q * GROUP`` rows (padded
  to a power of two, at least 16) of one ``tl.dot``: row ``m`` is query row ``m // GROUP`` of
  the block and head ``kv_head * GROUP + m % GROUP``. So each key and value tile is read once
  per KV head and query block, never once per query head.
* **Causal, bottom-right.** Query row ``i`` of a sequence with ``cache_len`` cached tokens sees
  positions ``[0, cache_len + i]``. A block reads only the tiles up to its last row's last
  visible position.
* **Pipelined tiles.** Where a decode or verification program's split is long, its loop over
  KV tiles is software-pipelined (``NUM_STAGES`` stages): the next tiles' keys and values are
  copied into shared memory asynchronously while the current one is summed, so the split
  streams its KV rather than waiting on every tile. Short splits (one or two tiles) load plainly.
* **Split-KV.** When the ``(query block, KV head)`` programs alone are too few to fill the GPU
  (decode at small batch sizes), each block's visible positions are cut into ``num_splits``
  equal parts (multiples of the tile length, sized by the block's own length, so a short sequence
  is spread as evenly as a long one). Each program then writes its float32 partial (running
  maximum, sum of exponentials, unnormalized output) and ``_merge_kernel`` combines the
  splits of every ``(row, head)``. With one split the first kernel writes the output itself.

* **Rotary inside** (:func:`paged_attention_qkv`). Where every sequence's rows fit one query block
  (decode, verification), the kernel can take the fused q/k/v projection instead of rotated queries:
  each program rotates its query rows, reads the step's own keys (rotated) and values from the
  projection in the tiles that hold their positions, and stores them into the pages, so the
  rotary-and-KV-write kernel does not run. The tiles and sums are those of the two kernels.

Scores, the online softmax and the output accumulate in float32 (``tl.exp2`` with the scale
folded into ``log2 e``); float32 inputs use IEEE dot products. Head sizes are padded to a
power of two (at least 16); any GQA group; any page size.

The grid is ``(num_seqs * cdiv(q_max, BLOCK_Q), kv_heads, num_splits)``: it depends only on the
step's sizes (sequences, the longest query, the page-table width, the head counts), never on
the lengths inside the metadata, and nothing synchronizes with the host. A launch can
therefore be captured in a CUDA graph whose replays take new lengths and page tables in the
same tensors; programs of query blocks a sequence does not have return at once.

This module imports ``triton``. Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported) runs the same kernels on CPU tensors, which is how the CPU tests
check them (:data:`INTERPRETED` says which mode this import got; the interpreter of Triton 3.9 or
later, :data:`INTERPRETER_MIN_TRITON`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .dependent_launch import pdl_args

# KV positions per tile. Programs of at most SMALL_BLOCK_M rows (decode, verification) whose splits are
# short read their one or two tiles of BLOCK_N_SMALL_M with plain loads (one long tile keeps the most loads
# in flight); where a split spans PIPELINED_SPLIT_LEN positions of the page table or more, the loop over its
# tiles is pipelined in NUM_STAGES stages over tiles of BLOCK_N (streaming, the shorter tile wins; the rule sees
# the page table's width, which a graph's bucket makes up to twice the longest sequence). Prefill
# tiles are always BLOCK_N long and loaded plainly (a 64 x 128 score tile and its accumulator would not fit
# the registers of NUM_WARPS warps).
BLOCK_N_SMALL_M = 128
BLOCK_N = 64
SMALL_BLOCK_M = 16
PIPELINED_SPLIT_LEN = 512
NUM_STAGES = 2
MAX_BLOCK_M = 64  # query rows (query positions x group heads) per program, at most
MIN_SPLIT_LEN = 128  # KV positions a split covers at least (a multiple of either tile length)
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2  # split until (query blocks x KV heads x splits) reaches this many programs per SM
PARTIALS_BYTES = 1 << 28  # float32 split partials one launch may hold (fewer splits beyond)
NUM_WARPS = 4
_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot's smallest M, N and K


@triton.jit
def _weigh(q, k, seen, m, scale_log2, IEEE: tl.constexpr):
    """A tile's keys ``k`` ``[HEAD_PAD, BLOCK_N]`` against the rows ``q``: the new running maximum,
    the factor ``alpha`` for the state before, and the tile's weights ``p`` (zero where not ``seen``)."""
    if IEEE:
        scores = tl.dot(q, k, input_precision="ieee")
    else:
        scores = tl.dot(q, k)
    scores = tl.where(seen, scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # A row that has seen nothing yet keeps m = -inf; exponentiate against 0 then (weights 0, no NaN).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m - m_ref), tl.exp2(scores - m_ref[:, None])


@triton.jit
def _fold(p, v, alpha, l, acc, IEEE: tl.constexpr):
    """The online softmax state after a tile: ``(l, acc)`` scaled by ``alpha`` plus its weights ``p``
    and their values ``v`` ``[BLOCK_N, HEAD_PAD]``."""
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return l * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _attend_tile(n0, hi, q, k_base, v_base, pt_base, row_visible, d, d_ok, m, l, acc, scale_log2, stride_kp,
                 stride_ko, stride_vp, stride_vo, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One KV tile (positions ``[n0, n0 + BLOCK_N)``, those below ``hi``) folded into the online
    softmax state ``(m, l, acc)`` of the program's rows."""
    pos = n0 + tl.arange(0, BLOCK_N)
    in_range = pos < hi
    page = tl.load(pt_base + pos // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
    slot = pos % PAGE_SIZE
    k = tl.load(k_base + page[None, :] * stride_kp + slot[None, :] * stride_ko + d[:, None],
                mask=in_range[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, BLOCK_N]
    seen = in_range[None, :] & (pos[None, :] < row_visible[:, None])
    m_new, alpha, p = _weigh(q, k, seen, m, scale_log2, IEEE)
    v = tl.load(v_base + page[:, None] * stride_vp + slot[:, None] * stride_vo + d[None, :],
                mask=in_range[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_PAD]
    l, acc = _fold(p, v, alpha, l, acc, IEEE)
    return m_new, l, acc


@triton.jit
def _rotated(x, rows, cos_rows, sin_rows, d, ok, HEAD_DIM: tl.constexpr):
    """``x`` (the elements ``d`` of the rows at ``rows``, loaded by the caller) rotated as
    :func:`tpspec.model.fused_triton.rotary_and_write_kv` rotates it: ``x * cos + rotate_half(x) *
    sin`` (half-split layout), each product and the sum rounded to ``x``'s dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    first = d < HALF
    partner = tl.load(rows + tl.where(first, d + HALF, d - HALF), mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_rows + d, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_rows + d, mask=ok, other=0.0).to(tl.float32)
    dtype = x.dtype
    turned = (tl.where(first, -partner, partner) * s).to(dtype).to(tl.float32)
    return ((x.to(tl.float32) * c).to(dtype).to(tl.float32) + turned).to(dtype)


@triton.jit
def _attend_mixed_tile(n0, hi, q, qkv_ptr, cos_ptr, sin_ptr, k_base, v_base, pt_base, start, cache_len, row_visible, d,
                       d_ok, m, l, acc, scale_log2, num_heads, kv_head, stride_qt, stride_ct, stride_st, stride_kp,
                       stride_ko, stride_vp, stride_vo, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_attend_tile` for a tile that may hold the step's own positions (``cache_len`` on):
    those keys and values come from the fused projection ``qkv`` (the keys rotated) and are stored
    into the pages (this program's split is the one that holds them); the rest from the pages. The
    same tile, the same products and sums: the bits of the two kernels it replaces."""
    pos = n0 + tl.arange(0, BLOCK_N)
    in_range = pos < hi
    new = in_range & (pos >= cache_len)
    cached = in_range & (pos < cache_len)
    page = tl.load(pt_base + pos // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
    slot = pos % PAGE_SIZE
    tok = start + pos - cache_len  # the step's row of each new position
    k_at = k_base + page[None, :] * stride_kp + slot[None, :] * stride_ko + d[:, None]
    k = tl.load(k_at, mask=cached[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, BLOCK_N]
    k_ok = new[None, :] & d_ok[:, None]
    k_rows = qkv_ptr + tok[None, :] * stride_qt + (num_heads + kv_head) * HEAD_DIM
    k_new = tl.load(k_rows + d[:, None], mask=k_ok, other=0.0)
    k_new = _rotated(k_new, k_rows, cos_ptr + tok[None, :] * stride_ct, sin_ptr + tok[None, :] * stride_st, d[:, None],
                     k_ok, HEAD_DIM)
    tl.store(k_at, k_new, mask=k_ok)
    k = tl.where(new[None, :], k_new, k)
    seen = in_range[None, :] & (pos[None, :] < row_visible[:, None])
    m_new, alpha, p = _weigh(q, k, seen, m, scale_log2, IEEE)
    v_at = v_base + page[:, None] * stride_vp + slot[:, None] * stride_vo + d[None, :]
    v = tl.load(v_at, mask=cached[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_PAD]
    v_ok = new[:, None] & d_ok[None, :]
    v_new = tl.load(qkv_ptr + tok[:, None] * stride_qt + (num_heads + tl.num_programs(1) + kv_head) * HEAD_DIM
                    + d[None, :], mask=v_ok, other=0.0)
    tl.store(v_at, v_new, mask=v_ok)
    v = tl.where(new[:, None], v_new, v)
    l, acc = _fold(p, v, alpha, l, acc, IEEE)
    return m_new, l, acc


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, seq_starts_ptr, tok_visible_ptr, part_acc_ptr,
                   part_m_ptr, part_l_ptr, cos_ptr, sin_ptr, scale_log2, num_heads, q_blocks, num_splits, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
                   stride_pt, stride_ct, stride_st, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, ROTARY: tl.constexpr,
                   PDL: tl.constexpr):
    # ROTARY: q_ptr is the fused projection (q, k and v heads of each token; one query block a
    # sequence): q and the step's own keys are rotated here, and the step's keys and values are read
    # from it and stored into the pages by the program whose split holds their positions.
    if PDL:  # tpspec.model.dependent_launch: nothing is read or written before the kernel before has finished
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = pid // q_blocks
    first = (pid % q_blocks) * BLOCK_Q  # the block's first query row within its sequence
    start = tl.load(seq_starts_ptr + seq).to(tl.int64)
    q_len = tl.load(seq_starts_ptr + seq + 1).to(tl.int64) - start
    if first >= q_len:
        return  # a query block this sequence does not have
    cache_len = tl.load(tok_visible_ptr + start).to(tl.int64) - 1  # its first row sees cache_len + 1 positions

    m_offs = tl.arange(0, BLOCK_M)
    qi = first + m_offs // GROUP  # each row's query row within the sequence
    heads = kv_head * GROUP + m_offs % GROUP
    row_ok = (m_offs < BLOCK_Q * GROUP) & (qi < q_len)
    tok = start + qi
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_rows = q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_rows + d[None, :], mask=q_ok, other=0.0)
    if ROTARY:
        q = _rotated(q, q_rows, cos_ptr + tok[:, None] * stride_ct, sin_ptr + tok[:, None] * stride_st, d[None, :],
                     q_ok, HEAD_DIM)
    row_visible = cache_len + qi + 1  # [BLOCK_M]: positions each row sees
    block_visible = cache_len + tl.minimum(q_len, first + BLOCK_Q)  # positions the block's last row sees
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(block_visible, num_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, block_visible)
    else:
        lo = block_visible * 0
        hi = block_visible

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    pt_base = page_table_ptr + seq * stride_pt
    if ROTARY:
        # The tiles from the one holding position cache_len on may hold the step's own positions.
        mixed_from = tl.minimum(lo + tl.maximum(cache_len - lo, 0) // BLOCK_N * BLOCK_N, hi)
    else:
        mixed_from = hi
    for n0 in range(lo, mixed_from, BLOCK_N):
        m, l, acc = _attend_tile(n0, hi, q, k_base, v_base, pt_base, row_visible, d, d_ok, m, l, acc, scale_log2,
                                 stride_kp, stride_ko, stride_vp, stride_vo, PAGE_SIZE, BLOCK_N, IEEE)
    if ROTARY:
        for n0 in range(mixed_from, hi, BLOCK_N):
            m, l, acc = _attend_mixed_tile(n0, hi, q, q_ptr, cos_ptr, sin_ptr, k_base, v_base, pt_base, start,
                                           cache_len, row_visible, d, d_ok, m, l, acc, scale_log2, num_heads, kv_head,
                                           stride_qt, stride_ct, stride_st, stride_kp, stride_ko, stride_vp, stride_vo,
                                           HEAD_DIM, PAGE_SIZE, BLOCK_N, IEEE)

    if SPLIT:
        part = (tok * num_heads + heads) * num_splits + split  # [BLOCK_M]
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # l > 0 on every real row: it sees position 0
        tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_PAD)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    part = (t * num_heads + head) * num_splits + s  # [SPLITS_PAD]
    # Split 0 holds position 0, which every row sees: the maximum is finite. Splits that saw
    # nothing of this row carry m = -inf and weigh 0.
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


INTERPRETED = isinstance(_attend_kernel, InterpretedFunction)
"""Whether this import got Triton's interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""

INTERPRETER_MIN_TRITON = (3, 9)
"""The oldest Triton whose interpreter runs these kernels (loops over bounds read from tensors)."""


def triton_version() -> tuple[int, int]:
    """The imported Triton's ``(major, minor)``."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: no parallel hardware to fill


def _query_block(q_max: int, group: int) -> tuple[int, int]:
    """``(block_m, block_q)``: a program's ``tl.dot`` rows and the query rows of one sequence they hold."""
    block_m = min(max(MAX_BLOCK_M, _pow2_at_least(group, _MIN_DOT)), _pow2_at_least(q_max * group, _MIN_DOT))
    return block_m, max(1, block_m // group)


@dataclass(frozen=True)
class Launch:
    """Block sizes and grid of one step's attention (from the step's sizes only)."""

    block_q: int  # query rows of one sequence per program
    block_m: int  # rows of a program's tl.dot: block_q * group, padded to a power of two >= 16
    q_blocks: int  # query blocks per sequence: cdiv(q_max, block_q)
    num_splits: int  # KV splits per query block (1: no merge)
    head_pad: int
    block_n: int  # KV positions per tile
    num_stages: int  # software-pipeline stages of the loop over a split's tiles (1: plain loads)


def plan_launch(*, num_tokens: int, num_seqs: int, q_max: int, kv_pages: int, page_size: int, num_heads: int,
                kv_heads: int, head_dim: int, device: torch.device | str,
                num_splits: int | None = None) -> Launch:
    """How :func:`paged_attention` launches for a step of these sizes.

    ``num_splits``: KV splits per query block (default: 1 when the ``num_seqs * q_blocks *
    kv_heads`` programs reach ``PROGRAMS_PER_SM`` per SM, else enough splits to get there, at
    most ``MAX_SPLITS``, at least ``MIN_SPLIT_LEN`` positions of the page table's
    ``kv_pages * page_size`` a split, and within ``PARTIALS_BYTES`` of float32 partials). The
    tile length and pipeline stages follow from the rows a program holds and the positions of
    the page table a split spans (the comment above ``BLOCK_N_SMALL_M``).
    Depends only on these arguments (and the device's SM count), never on a tensor's values.
    """
    block_m, block_q = _query_block(q_max, num_heads // kv_heads)
    q_blocks = triton.cdiv(max(q_max, 1), block_q)
    head_pad = _pow2_at_least(head_dim, _MIN_DOT)
    if num_splits is None:
        programs = num_seqs * q_blocks * kv_heads
        target = PROGRAMS_PER_SM * _sm_count(torch.device(device))
        num_splits = 1
        if programs < target:
            by_length = triton.cdiv(kv_pages * page_size, MIN_SPLIT_LEN)
            by_memory = PARTIALS_BYTES // max(1, 4 * num_tokens * num_heads * (head_pad + 2))
            num_splits = max(1, min(triton.cdiv(target, programs), by_length, by_memory, MAX_SPLITS))
    elif not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    short_rows = block_m <= SMALL_BLOCK_M  # decode, verification
    pipelined = short_rows and triton.cdiv(kv_pages * page_size, num_splits) >= PIPELINED_SPLIT_LEN
    block_n = BLOCK_N_SMALL_M if short_rows and not pipelined else BLOCK_N
    return Launch(block_q=block_q, block_m=block_m, q_blocks=q_blocks, num_splits=num_splits, head_pad=head_pad,
                  block_n=block_n, num_stages=NUM_STAGES if pipelined else 1)


def sequence_starts(tok_seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``[num_seqs + 1]`` int64 on ``tok_seq``'s device: the first query row of each sequence, then
    the row count (``tok_seq`` ``[N]``: each row's sequence, in order). No host synchronization."""
    ids = torch.arange(num_seqs + 1, dtype=tok_seq.dtype, device=tok_seq.device)
    return torch.searchsorted(tok_seq, ids)


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    seq_starts: torch.Tensor, tok_visible: torch.Tensor, scale: float, *, q_max: int,
                    num_splits: int | None = None) -> torch.Tensor:
    """Causal paged attention of a step's query rows (module docstring).

    Parameters
    ----------
    q : ``[N, H, head_dim]`` float32, float16 or bfloat16: the step's query rows, sequence by
        sequence (rows ``seq_starts[b]:seq_starts[b + 1]`` are sequence ``b``'s, in order).
    k_pages, v_pages : ``[num_pages, page_size, kv_heads, head_dim]`` in ``q``'s dtype (one layer of
        :class:`~tpspec.model.kv_cache.KVPages`), last dimension contiguous; ``H`` a multiple of
        ``kv_heads``.
    page_table : ``[B, kv_pages]`` integer: sequence ``b``'s pages in order; it must cover every
        position its rows see (columns past them are never read).
    seq_starts : ``[B + 1]`` integer (:func:`sequence_starts`); every sequence has a row.
    tok_visible : ``[N]`` integer: the positions row ``t`` sees, ``cache_len + i + 1`` for query row
        ``i`` of its sequence (only each sequence's first entry is read: rows are consecutive).
    scale : the softmax scale.
    q_max : the most query rows of a sequence (sizes the grid; a CUDA graph fixes it).
    num_splits : KV splits (default: :func:`plan_launch`'s rule).

    Returns ``[N, H, head_dim]`` in ``q``'s dtype. Launch sizes come from the tensors' shapes,
    ``q_max`` and ``num_splits`` only: no host synchronization, capturable in a CUDA graph.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [N, heads, head_dim], got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    return _attend(q, q.shape[1], q.stride(0), q.stride(1), None, None, k_pages, v_pages, page_table, seq_starts,
                   tok_visible, scale, q_max=q_max, num_splits=num_splits)


def fits_one_query_block(*, q_max: int, num_heads: int, kv_heads: int) -> bool:
    """Whether every sequence's query rows (at most ``q_max``) fit one program's query block, as
    :func:`paged_attention_qkv` needs (decode and verification steps; not long prefill chunks)."""
    return q_max <= _query_block(q_max, num_heads // kv_heads)[1]


def paged_attention_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pages: torch.Tensor,
                        v_pages: torch.Tensor, page_table: torch.Tensor, seq_starts: torch.Tensor,
                        tok_visible: torch.Tensor, scale: float, *, num_heads: int, q_max: int,
                        num_splits: int | None = None) -> torch.Tensor:
    """:func:`tpspec.model.fused_triton.rotary_and_write_kv` and :func:`paged_attention` in one
    kernel, for steps whose sequences' rows fit one query block (:func:`fits_one_query_block`:
    decode and verification).

    ``qkv`` is the fused projection ``[N, (num_heads + 2 * kv_heads) * head_dim]`` (q heads, k
    heads, v heads), ``cos`` and ``sin`` ``[N, head_dim]`` in its dtype; the rest as for
    :func:`paged_attention`. Each program rotates its query rows, reads the cached positions from
    the pages and the step's own keys and values from ``qkv`` (the keys rotated); the program whose
    split holds a new position stores its key and value into the pages, at the row the page table
    gives position ``tok_visible - 1`` (where ``rotary_and_write_kv``'s ``write_index`` points).
    Returns the output of those two calls, bit for bit in float16 and bfloat16 (the rotary rounding
    of ``rotary_and_write_kv``: each product and the sum rounded to the dtype; in float32 a CUDA
    build may contract a product and the sum into one FMA, which that kernel does not), and leaves
    the pages as they leave them. ``ValueError`` for shapes that do not fit or rows past one query
    block.
    """
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [N, features], got {tuple(qkv.shape)}")
    if k_pages.dim() != 4:
        raise ValueError(f"k_pages must be [num_pages, page_size, kv_heads, head_dim], got {tuple(k_pages.shape)}")
    n = qkv.shape[0]
    kv_heads, head_dim = k_pages.shape[2:]
    if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {kv_heads} heads of the pages' even "
                         f"head_dim {head_dim}")
    if cos.shape != (n, head_dim) or sin.shape != (n, head_dim) or not qkv.dtype == cos.dtype == sin.dtype:
        raise ValueError(f"cos and sin must be [{n}, {head_dim}] in {qkv.dtype}, got {tuple(cos.shape)} {cos.dtype} "
                         f"and {tuple(sin.shape)} {sin.dtype}")
    if num_heads % max(kv_heads, 1) or not fits_one_query_block(q_max=q_max, num_heads=num_heads, kv_heads=kv_heads):
        raise ValueError(f"q_max={q_max} rows of {num_heads} heads over {kv_heads} KV heads do not fit one query "
                         f"block: run rotary_and_write_kv, then paged_attention")
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qkv, cos and sin need a contiguous last dimension")
    return _attend(qkv, num_heads, qkv.stride(0), head_dim, cos, sin, k_pages, v_pages, page_table, seq_starts,
                   tok_visible, scale, q_max=q_max, num_splits=num_splits)


def _attend(q: torch.Tensor, num_heads: int, stride_qt: int, stride_qh: int, cos: torch.Tensor | None,
            sin: torch.Tensor | None, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
            seq_starts: torch.Tensor, tok_visible: torch.Tensor, scale: float, *, q_max: int,
            num_splits: int | None) -> torch.Tensor:
    """The launch behind both entry points: ``q`` holds the query heads at ``stride_qt`` a row and
    ``stride_qh`` a head (with ``cos`` and ``sin``: the fused projection, rotated in the kernel)."""
    n = q.shape[0]
    _, page_size, kv_heads, head_dim = k_pages.shape
    if num_heads % kv_heads or (cos is None and q.shape[2] != head_dim) or v_pages.shape != k_pages.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit K/V pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)}: "
                         f"heads must be a multiple of kv_heads and head sizes equal")
    if not q.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(f"q, k_pages and v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("K/V pages need a contiguous last dimension")
    num_seqs = page_table.shape[0]
    if seq_starts.shape != (num_seqs + 1,):
        raise ValueError(f"seq_starts must have {num_seqs + 1} entries (page_table rows + 1), got "
                         f"{tuple(seq_starts.shape)}")
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    launch = plan_launch(num_tokens=n, num_seqs=num_seqs, q_max=q_max, kv_pages=page_table.shape[1],
                         page_size=page_size, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
                         device=q.device, num_splits=num_splits)
    splits = launch.num_splits
    f32 = torch.float32
    if splits > 1:
        part_acc = torch.empty(n * num_heads * splits * launch.head_pad, dtype=f32, device=q.device)
        part_m = torch.empty(n * num_heads * splits, dtype=f32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # not read: the kernel writes the output itself
    rotary = cos is not None
    pdl = pdl_args(q.device)
    # FP fusion pinned on, as every GPU run compiled these kernels (Triton 3.10 turns its default off).
    grid = (num_seqs * launch.q_blocks, kv_heads, splits)
    _attend_kernel[grid](
        q, k_pages, v_pages, out, page_table, seq_starts, tok_visible, part_acc, part_m, part_l,
        cos if rotary else q, sin if rotary else q, scale * _LOG2E, num_heads, launch.q_blocks, splits, stride_qt,
        stride_qh, out.stride(0), out.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), page_table.stride(0),
        cos.stride(0) if rotary else 0, sin.stride(0) if rotary else 0,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad, PAGE_SIZE=page_size,
        BLOCK_Q=launch.block_q, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, SPLIT=splits > 1, IEEE=q.dtype == f32,
        ROTARY=rotary, num_warps=NUM_WARPS,
        num_stages=launch.num_stages, enable_fp_fusion=True, **pdl)
    if splits > 1:
        _merge_kernel[(n, num_heads)](part_acc, part_m, part_l, out, num_heads, splits, out.stride(0), out.stride(1),
                                      HEAD_DIM=head_dim, HEAD_PAD=launch.head_pad,
                                      SPLITS_PAD=_pow2_at_least(splits, 1), num_warps=NUM_WARPS,
                                      enable_fp_fusion=True, **pdl)
    return out
