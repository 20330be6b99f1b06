"""One Triton kernel for strict acceptance of a graphed verification step: what
:func:`tpspec.speculative.accept.accept_from_targets` (after the gather of each request's rows'
tokens) does in about ten small torch kernels, in one launch of a program a request.

For request ``b``: its rows' target tokens ``row_tokens[row_index[b]]``, its drafts accepted while
each equals the target's token at its position (and lies within ``lens[b]``), the accepted prefix
and the target's token after it emitted, ``PAD_TOKEN`` past it. The same values as the torch path,
which stays the reference and the CPU path (``tests/advance_cases.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .accept import PAD_TOKEN


@triton.jit
def _accept_kernel(row_tokens_ptr, row_index_ptr, drafts_ptr, lens_ptr, accepted_ptr, num_ptr, D: tl.constexpr,
                   D1_PAD: tl.constexpr, PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, D1_PAD)
    in_row = j < D + 1
    is_draft = j < D
    rows = tl.load(row_index_ptr + b * (D + 1) + j, mask=in_row, other=0)
    target = tl.load(row_tokens_ptr + rows, mask=in_row, other=0).to(tl.int64)
    draft = tl.load(drafts_ptr + b * D + j, mask=is_draft, other=0).to(tl.int64)
    counted = j.to(tl.int64) < tl.load(lens_ptr + b).to(tl.int64)
    match = is_draft & (draft == target) & counted
    # The drafts accepted: those before the first that does not match (all D when every one does).
    accepted_drafts = tl.min(tl.where(is_draft & ~match, j, D), axis=0)
    tl.store(accepted_ptr + b * (D + 1) + j, tl.where(j <= accepted_drafts, target, PAD), mask=in_row)
    tl.store(num_ptr + b, (accepted_drafts + 1).to(tl.int64))


def accept(row_tokens: torch.Tensor, row_index: torch.Tensor, drafts: torch.Tensor,
           lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_from_targets(row_tokens[row_index], drafts, lens, check_values=False)`` in one launch.

    ``row_tokens``: ``[R]`` integer, the target's token of each logits row; ``row_index``: ``[B, D +
    1]`` integer, each request's rows; ``drafts``: ``[B, D]`` integer; ``lens``: ``[B]`` integer, the
    drafts that count (``0 .. D``). Returns ``(accepted [B, D + 1] int64, num_accepted [B] int64)``,
    as the torch function returns them. No host synchronization."""
    batch, width = row_index.shape
    if drafts.shape != (batch, width - 1) or lens.shape != (batch,) or row_tokens.dim() != 1:
        raise ValueError(f"row_index {tuple(row_index.shape)}, drafts {tuple(drafts.shape)}, lens {tuple(lens.shape)} "
                         f"and row_tokens {tuple(row_tokens.shape)} do not fit [B, D + 1], [B, D], [B] and [R]")
    accepted = torch.empty((batch, width), dtype=torch.int64, device=row_tokens.device)
    num = torch.empty(batch, dtype=torch.int64, device=row_tokens.device)
    if batch:
        _accept_kernel[(batch,)](row_tokens.contiguous(), row_index.contiguous(), drafts.contiguous(),
                                 lens.contiguous(), accepted, num, D=width - 1,
                                 D1_PAD=triton.next_power_of_2(width), PAD=PAD_TOKEN, num_warps=1,
                                 enable_fp_fusion=False)
    return accepted, num
