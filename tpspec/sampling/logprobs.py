"""Logprobs of chosen tokens from the gathered logits rows.

What a request with ``SamplingParams(logprobs=N)`` reports: the log-softmax of the RAW
logits (before penalties and temperature), for the token it got and for the N most likely
tokens of that row. Computed in float64 on the gathered rows, so every rank and every TP
size gets the same values.
"""

from __future__ import annotations

import torch

from ..vocab_parallel import VocabShardedLogits
from .params import MAX_LOGPROBS


def gathered_logprobs(logits: VocabShardedLogits, tokens: torch.Tensor, *,
                      top_n: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_logprobs [R], top_ids [R, N], top_logprobs [R, N])`` of ``logits``' rows.

    ``tokens``: ``[R]`` int64 global token ids; ``top_n``: N in ``[0, 20]``. Logprobs are
    float64 ``log_softmax`` of the raw logits; the top N are ordered by logprob, ties to the
    lower token id. Collective over the logits' group (one all-gather of the rows); every
    rank returns the same tensors.
    """
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= MAX_LOGPROBS:
        raise ValueError(f"top_n must be an int in [0, {MAX_LOGPROBS}], got {top_n!r}")
    if tokens.dim() != 1 or tokens.shape[0] != logits.num_rows:
        raise ValueError(f"tokens must be [{logits.num_rows}], got {tuple(tokens.shape)}")
    full = logits.gather().to(torch.float64)
    logp = torch.log_softmax(full, dim=-1)
    token_lp = logp.gather(1, tokens.to(device=logp.device, dtype=torch.int64).reshape(-1, 1)).reshape(-1)
    # A stable sort keeps equal values in column order: ties go to the lower token id.
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[:, :top_n]
    return token_lp, order, logp.gather(1, order)
