"""Logprobs of chosen tokens from the gathered logits rows.

What a request with ``SamplingParams(logprobs=N)`` reports: the log-softmax of the RAW
logits (before penalties and temperature), for the token it got and for the N most likely
tokens of that row. :func:`gathered_logprobs` computes them in float64 on the gathered rows,
so every rank and every TP size gets the same values; :func:`emitted_logprobs` turns one
step's rows into the per-token dicts the runtime reports.
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


def emitted_logprobs(logits: VocabShardedLogits, row_index: torch.Tensor, tokens: torch.Tensor,
                     num_emitted: torch.Tensor, top_n: list[int]) -> list[list[dict[int, float]]]:
    """What ``RequestOutput.logprobs`` gets for one step of ``B`` requests.

    ``row_index`` ``[B, P]``: the logits row of each request's position (see
    ``SpecMetadata.request_row_index``); ``tokens`` ``[B, P]``: the tokens emitted there
    (padding ignored); ``num_emitted`` ``[B]``; ``top_n``: each request's N. Returns, per
    request, one ``{token id: logprob}`` per emitted token: its N most likely tokens and the
    emitted token itself. Collective over the logits' group (every rank passes the same rows).
    """
    rows, width = row_index.shape
    device = logits.local.device
    picked = VocabShardedLogits(logits.local[row_index.to(device).reshape(-1)], logits.vocab_offset,
                                logits.vocab_size, logits.exchange)
    flat_tokens = tokens.to(device).reshape(-1).clamp(min=0)  # padding positions: any column, never read
    token_lp, top_ids, top_lp = gathered_logprobs(picked, flat_tokens, top_n=max(top_n, default=0))
    token_lp = token_lp.reshape(rows, width).tolist()
    ids = flat_tokens.reshape(rows, width).tolist()
    top_ids = top_ids.reshape(rows, width, -1).tolist()
    top_lp = top_lp.reshape(rows, width, -1).tolist()
    out = []
    for b, (n, count) in enumerate(zip(top_n, num_emitted.tolist())):
        out.append([{**dict(zip(top_ids[b][j][:n], top_lp[b][j][:n])), ids[b][j]: token_lp[b][j]}
                    for j in range(int(count))])
    return out
