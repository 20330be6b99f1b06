"""Deterministic mode's paged attention on CUDA: fixed splits by absolute position (Triton).

Query row ``t`` (a token of sequence ``b``) sees KV positions ``[0, visible_t)``,
``visible_t = cache_len_b + i + 1``. Its result must depend only on its own query and those
keys and values — not on the batch, its neighbours, how many query rows its sequence feeds
(decode, verification of drafts, a prefill chunk), how many pages the step allocated or the
batch's longest sequence. Two kernels keep that contract:

1. **Splits.** The KV axis is cut at fixed absolute positions into splits of ``SPLIT_SIZE``
   positions. One program per ``(row, kv head, split)`` walks its split in blocks of
   ``BLOCK_N`` positions, in order, with the online softmax (scores by ``tl.dot`` over
   ``head_dim``, a running max ``m``, ``l = sum exp``, ``acc = sum p * v``, all float32) and
   stops at the row's last visible block; positions at or past ``visible`` are never loaded
   and score ``-inf`` (weight exactly 0). A split that starts at or past ``visible`` does
   nothing. All the query heads of one KV head (the GQA group, padded to the ``tl.dot``
   minimum with zero rows) share a program; rows of a ``tl.dot`` do not mix.
2. **Combine.** One program per ``(row, kv head)`` merges the row's visible splits
   ``0 .. n - 1`` (``n = ceil(visible / SPLIT_SIZE)``) by the binary tree of adjacent pairs
   over split indices, in which a right subtree starting at or past ``n`` is dropped (the left
   one passes up unchanged), exactly as :func:`tpspec.model.deterministic.prefix_tree_sum`
   treats positions. The tree's shape depends on ``n`` alone, so the launch's number of
   splits (from the metadata's page-table width) never changes a row's bits.

Every block size is a constant (no autotuning), the integer arguments are not specialized,
and the grids come from ``num_tokens`` and the page-table width — sizes fixed when the step is
planned — so there is no host synchronization and the launch can be captured in a CUDA graph.
The bits are the GPU's own: they match neither the CPU's fixed-order path nor another GPU
model (``tl.exp2`` and the MMA instructions differ), only themselves.

This module imports ``triton``; import it only where Triton is available (CUDA), never on a
CPU-only path. Triton's interpreter (``TRITON_INTERPRET=1`` before ``triton`` is imported)
runs the same kernels on CPU tensors, which is how the CPU tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# KV positions per split (fixed: a row's tree of splits depends on it). One block a split: a split's
# program walks its positions one after another, so short splits spread a row over more programs.
SPLIT_SIZE = 64
BLOCK_N = 64  # KV positions per tl.dot inside a split (SPLIT_SIZE is a multiple)
NUM_WARPS = 4
PARTIALS_BYTES = 1 << 28  # float32 split partials one launch may hold; more rows launch in chunks
_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot's smallest M, N and K


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


@triton.jit(do_not_specialize=["num_heads", "num_splits", "page_size", "stride_qt", "stride_qh", "stride_kp",
                               "stride_ko", "stride_kh", "stride_vp", "stride_vo", "stride_vh", "stride_pt"])
def _split_kernel(q_ptr, k_ptr, v_ptr, page_table_ptr, tok_seq_ptr, tok_visible_ptr, part_acc_ptr, part_m_ptr,
                  part_l_ptr, scale_log2, num_heads, num_splits, page_size, stride_qt, stride_qh, stride_kp,
                  stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, stride_pt,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, VEC: tl.constexpr):
    # The K/V strides are whole multiples of VEC elements (the wrapper's rule, from head_dim and the dtype
    # alone); written as such, the compiler sees it and loads a position's head in 16-byte pieces. The
    # integers stay unspecialized, so one binary serves every batch and TP size.
    stride_kp = stride_kp // VEC * VEC
    stride_ko = stride_ko // VEC * VEC
    stride_kh = stride_kh // VEC * VEC
    stride_vp = stride_vp // VEC * VEC
    stride_vo = stride_vo // VEC * VEC
    stride_vh = stride_vh // VEC * VEC
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tok_seq_ptr + t).to(tl.int64)
    visible = tl.load(tok_visible_ptr + t).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    start = split.to(tl.int64) * SPLIT
    # Blocks of this split holding visible positions (0 for a split past the row's end).
    n_blocks = tl.minimum(tl.maximum((visible - start + BLOCK - 1) // BLOCK, 0), SPLIT // BLOCK)
    offs = tl.arange(0, BLOCK)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    # (while loops, not range() over a tensor bound, so Triton's interpreter runs them too)
    i = n_blocks * 0
    while i < n_blocks:
        pos = start + i * BLOCK + offs
        seen = pos < visible
        page = tl.load(page_table_ptr + seq * stride_pt + pos // page_size, mask=seen, other=0).to(tl.int64)
        slot = pos % page_size
        kv_ok = seen[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ko + kv_head * stride_kh + d[None, :],
                    mask=kv_ok, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(seen[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vo + kv_head * stride_vh + d[None, :],
                    mask=kv_ok, other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
        i += 1
    row = (t.to(tl.int64) * num_heads + heads) * num_splits + split  # [GROUP_PAD]
    # A tensor compare, not ``g_ok & (n_blocks > 0)``: Triton's interpreter (3.9) types a tensor
    # ``&`` a scalar bool as int32, which tl.store refuses as a mask.
    keep = g_ok & (n_blocks > tl.zeros_like(g))
    tl.store(part_m_ptr + row, m, mask=keep)
    tl.store(part_l_ptr + row, l, mask=keep)
    tl.store(part_acc_ptr + row[:, None] * HEAD_PAD + d[None, :], acc, mask=keep[:, None])


@triton.jit(do_not_specialize=["num_heads", "num_splits", "stride_ot", "stride_oh"])
def _combine_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, tok_visible_ptr, out_ptr, num_heads, num_splits,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                    SPLIT: tl.constexpr):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    visible = tl.load(tok_visible_ptr + t).to(tl.int64)
    n = (visible + SPLIT - 1) // SPLIT  # the row's visible splits, >= 1
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    base = (t.to(tl.int64) * num_heads + heads) * num_splits  # [GROUP_PAD]: split 0 of each head
    # Level by level, node [left, left + 2 * span) = node left (+) node left + span, stored in
    # place at ``left``; a right node starting at or past n is dropped (left stays as it is).
    span = n * 0 + 1
    while span < n:
        left = span * 0
        while left + span < n:
            a = base + left
            b = a + span
            m1 = tl.load(part_m_ptr + a, mask=g_ok, other=0.0)
            m2 = tl.load(part_m_ptr + b, mask=g_ok, other=0.0)
            l1 = tl.load(part_l_ptr + a, mask=g_ok, other=0.0)
            l2 = tl.load(part_l_ptr + b, mask=g_ok, other=0.0)
            acc1 = tl.load(part_acc_ptr + a[:, None] * HEAD_PAD + d[None, :], mask=g_ok[:, None], other=0.0)
            acc2 = tl.load(part_acc_ptr + b[:, None] * HEAD_PAD + d[None, :], mask=g_ok[:, None], other=0.0)
            m = tl.maximum(m1, m2)
            w1 = tl.exp2(m1 - m)
            w2 = tl.exp2(m2 - m)
            tl.store(part_m_ptr + a, m, mask=g_ok)
            tl.store(part_l_ptr + a, l1 * w1 + l2 * w2, mask=g_ok)
            tl.store(part_acc_ptr + a[:, None] * HEAD_PAD + d[None, :], acc1 * w1[:, None] + acc2 * w2[:, None],
                     mask=g_ok[:, None])
            left += 2 * span
        tl.debug_barrier()  # the next level reads what every thread of this one wrote
        span = span * 2
    l = tl.load(part_l_ptr + base, mask=g_ok, other=1.0)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_PAD + d[None, :], mask=g_ok[:, None], other=0.0)
    out = acc / l[:, None]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (d[None, :] < HEAD_DIM))


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    tok_seq: torch.Tensor, tok_visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal paged attention with fixed splits by absolute position (module docstring).

    Parameters
    ----------
    q : ``[N, H, head_dim]`` float32, float16 or bfloat16, the step's query rows.
    k_pages, v_pages : ``[num_pages, page_size, kv_heads, head_dim]``, ``q``'s dtype, contiguous
        (one layer of :class:`~tpspec.model.kv_cache.KVPages`); ``H`` a multiple of ``kv_heads``.
    page_table : ``[B, kv_pages]`` integer, sequence ``b``'s pages in order; it must cover every
        position a row of ``b`` sees (columns past that are never read).
    tok_seq : ``[N]`` integer, the sequence of each row.
    tok_visible : ``[N]`` integer >= 1, the KV positions row ``t`` sees (``cache_len + i + 1``).
    scale : the softmax scale.

    Returns ``[N, H, head_dim]`` in ``q``'s dtype: row ``t`` is a function of ``q[t]`` and the keys
    and values at positions ``[0, tok_visible[t])`` of its sequence only (bit for bit, on one GPU
    model and build). Launch sizes come from ``N`` and ``kv_pages`` only: no host sync. Rows are
    launched in chunks whose split partials fit ``PARTIALS_BYTES`` (each row's programs are the
    same in any chunk).
    """
    n, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of kv_heads={kv_heads}")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("paged_attention needs contiguous K/V pages")
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    group = num_heads // kv_heads
    group_pad = _pow2_at_least(group, _MIN_DOT)
    head_pad = _pow2_at_least(head_dim, _MIN_DOT)
    num_splits = triton.cdiv(page_table.shape[1] * page_size, SPLIT_SIZE)
    rows_per_launch = max(1, min(n, PARTIALS_BYTES // (4 * num_heads * num_splits * (head_pad + 2))))
    f32 = torch.float32
    part_acc = torch.empty(rows_per_launch * num_heads * num_splits * head_pad, dtype=f32, device=q.device)
    part_m = torch.empty(rows_per_launch * num_heads * num_splits, dtype=f32, device=q.device)
    part_l = torch.empty_like(part_m)
    # Contiguous pages: every K/V stride is a multiple of head_dim, so of VEC where head_dim is.
    vec = 16 // q.element_size()
    vec = vec if head_dim % vec == 0 else 1
    consts = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLIT=SPLIT_SIZE)
    for start in range(0, n, rows_per_launch):
        rows = slice(start, min(n, start + rows_per_launch))
        q_rows, seq_rows, visible_rows, out_rows = q[rows], tok_seq[rows], tok_visible[rows], out[rows]
        count = q_rows.shape[0]
        # FP fusion pinned on, as every GPU run compiled these kernels (Triton 3.10 turns its default off).
        _split_kernel[(count, kv_heads, num_splits)](
            q_rows, k_pages, v_pages, page_table, seq_rows, visible_rows, part_acc, part_m, part_l, scale * _LOG2E,
            num_heads, num_splits, page_size, q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1),
            k_pages.stride(2), v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), page_table.stride(0),
            BLOCK=BLOCK_N, IEEE=q.dtype == f32, VEC=vec, num_warps=NUM_WARPS, enable_fp_fusion=True, **consts)
        _combine_kernel[(count, kv_heads)](part_acc, part_m, part_l, visible_rows, out_rows, num_heads, num_splits,
                                           out.stride(0), out.stride(1), num_warps=NUM_WARPS, enable_fp_fusion=True,
                                           **consts)
    return out

