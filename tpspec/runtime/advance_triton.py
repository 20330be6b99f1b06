"""One Triton kernel for the device work of a verification step launched ahead: what
:meth:`GraphInputs.advance` (with :meth:`NgramDrafter.draft_on_device`) does in some sixty small torch
kernels, in one launch of a program a request.

For request ``b`` of the padded batch (padding requests are left as they are): write the tokens it
emitted (``accepted[b, :num[b]]``) into its row of the token history at the positions after its
last token, grow its cached length by ``num[b]``, set its positions, visible lengths and KV write
rows, its last token, and its drafts: the n-gram drafter over its history, now ``cache_len + 1``
tokens long (the latest longest earlier match of its last ``n`` tokens, ``min_ngram <= n <=
max_ngram``, and what followed it, padded with the last token it gives). The same values as the
torch path, which stays the reference and the CPU path (``tests/test_runtime_graphs.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.drafters import NgramDrafter
from .graph_inputs import GraphInputs

_HISTORY_BLOCK = 1024  # history positions one loop iteration compares


@triton.jit
def _advance_kernel(accepted_ptr, num_ptr, cache_ptr, positions_ptr, visible_ptr, write_ptr, tokens_ptr,
                    drafts_ptr, table_ptr, history_ptr, slots_ptr, num_padding, vocab, page_size, kv_pages,
                    history_width, K1: tl.constexpr, K1_P2: tl.constexpr, MAX_N: tl.constexpr,
                    MIN_N: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if b >= num_padding:
        j = tl.arange(0, K1_P2)
        in_row = j < K1
        n = tl.minimum(tl.maximum(tl.load(num_ptr + b), 1), K1)
        cache = tl.load(cache_ptr + b)
        row = history_ptr + tl.load(slots_ptr + b) * history_width
        emitted = tl.load(accepted_ptr + b * K1 + j, mask=in_row, other=0)
        emitted = tl.minimum(tl.maximum(emitted, 0), vocab - 1)
        # The emitted tokens join the history after the last token (position ``cache``).
        at = cache + 1 + j
        tl.store(row + at, emitted.to(tl.int32), mask=(j < n) & (at < history_width))
        cache += n
        tl.store(cache_ptr + b, cache)
        pos = cache + j
        tl.store(positions_ptr + b * K1 + j, pos, mask=in_row)
        tl.store(visible_ptr + b * K1 + j, pos + 1, mask=in_row)
        page = tl.load(table_ptr + b * kv_pages + pos // page_size, mask=in_row, other=0)
        tl.store(write_ptr + b * K1 + j, page * page_size + pos % page_size, mask=in_row)
        tl.store(tokens_ptr + b * K1, tl.sum(tl.where(j == n - 1, emitted, 0)))
        tl.debug_barrier()  # the history's new tokens, written by other threads, are read below
        # The n-gram drafter (``NgramDrafter.propose``): position e < last ends a match of size n when
        # the n tokens up to e equal the last n, n <= MAX_N (and so n <= e + 1 <= last).
        last = cache  # the history is last + 1 tokens long
        best = tl.full((), -1, tl.int64)
        for start in range(0, last, BLOCK):
            e = start + tl.arange(0, BLOCK)
            run = (e < last) & (tl.load(row + e, mask=e < last, other=0) == tl.load(row + last))
            size = run.to(tl.int64)
            for k in tl.static_range(1, MAX_N):
                earlier = tl.load(row + e - k, mask=(e < last) & (e >= k), other=0)
                tail = tl.load(row + tl.maximum(last - k, 0))
                run = run & (e >= k) & (earlier == tail)
                size += run.to(tl.int64)
            # The longest match wins, the latest among equals.
            score = tl.where(size >= MIN_N, size * history_width + e, -1)
            best = tl.maximum(best, tl.max(score, axis=0))
        first = tl.where(best >= 0, best % history_width + 1, last)
        d = tl.arange(0, K1_P2)
        in_drafts = d < K1 - 1
        drafted = tl.load(row + tl.minimum(first + d, last), mask=in_drafts, other=0).to(tl.int64)
        tl.store(drafts_ptr + b * (K1 - 1) + d, drafted, mask=in_drafts)
        tl.store(tokens_ptr + b * K1 + 1 + d, drafted, mask=in_drafts)


def advance(inputs: GraphInputs, accepted: torch.Tensor, num: torch.Tensor, num_padding: int,
            history: torch.Tensor, slot_rows: torch.Tensor, drafter: NgramDrafter, vocab_size: int) -> None:
    """:meth:`GraphInputs.advance` of ``inputs`` (a step with drafts) in one launch, without a host
    sync: each real request's emitted tokens into its row ``slot_rows[b]`` (``[batch]`` int64) of
    ``history`` (``[rows, width]`` int32, contiguous), its inputs moved on, ``drafter``'s drafts.
    ``accepted`` ``[batch, K + 1]`` (contiguous) and ``num`` ``[batch]`` int64: the step's outputs
    (tokens clamped to ``0 .. vocab_size - 1``, counts to ``1 .. K + 1``). The same values as the
    torch method."""
    t = inputs.tensors
    k1 = inputs.num_draft + 1
    if drafter.num_draft_tokens != inputs.num_draft or inputs.num_draft < 1:
        raise ValueError(f"advance: {inputs.num_draft} drafts a request, the drafter makes {drafter.num_draft_tokens}")
    _advance_kernel[(inputs.batch,)](
        accepted, num, t["cache_lens"], t["positions"], t["tok_visible"], t["write_index"], t["tokens"], t["drafts"],
        t["page_table"], history, slot_rows, num_padding, vocab_size, inputs.page_size, inputs.kv_pages,
        history.shape[1], K1=k1, K1_P2=triton.next_power_of_2(k1), MAX_N=drafter.max_ngram,
        MIN_N=drafter.min_ngram, BLOCK=_HISTORY_BLOCK)
