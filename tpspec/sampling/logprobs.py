"""Logprobs of the emitted tokens, as the runtime reports them.

What a request with ``SamplingParams(logprobs=N)`` reports: the log-softmax of the RAW
logits (before penalties and temperature), for the token it got and for the N most likely
tokens of that row. ``VocabShardedLogits.logprobs`` computes them on the shards (the row max
and the exact int64 sum of the masses: the same values at every TP size, within 1e-5 of
float64 ``log_softmax``); :func:`emitted_logprobs` turns one step's rows into the per-token
dicts the runtime reports.
"""

from __future__ import annotations

import torch

from ..vocab_parallel import VocabShardedLogits


def emitted_logprobs(logits: VocabShardedLogits, row_index: torch.Tensor, tokens: torch.Tensor,
                     num_emitted: torch.Tensor, top_n: list[int]) -> list[list[dict[int, float]]]:
    """What ``RequestOutput.logprobs`` gets for one step of ``B`` requests.

    ``row_index`` ``[B, P]``: the logits row of each request's position (see
    ``SpecMetadata.request_row_index``); ``tokens`` ``[B, P]``: the tokens emitted there
    (padding ignored); ``num_emitted`` ``[B]``; ``top_n``: each request's N. Returns, per
    request, one ``{token id: logprob}`` per emitted token: its N most likely tokens and the
    emitted token itself (float values of the float32 logprobs). Collective over the logits'
    group (every rank passes the same rows).
    """
    rows, width = row_index.shape
    device = logits.local.device
    picked = VocabShardedLogits(logits.local[row_index.to(device).reshape(-1)], logits.vocab_offset,
                                logits.vocab_size, logits.exchange)
    flat_tokens = tokens.to(device).reshape(-1).clamp(min=0)  # padding positions: any column, never read
    token_lp, top_ids, top_lp = picked.logprobs(flat_tokens, top_n=max(top_n, default=0))
    token_lp = token_lp.reshape(rows, width).tolist()
    ids = flat_tokens.reshape(rows, width).tolist()
    top_ids = top_ids.reshape(rows, width, -1).tolist()
    top_lp = top_lp.reshape(rows, width, -1).tolist()
    out = []
    for b, (n, count) in enumerate(zip(top_n, num_emitted.tolist())):
        out.append([{**dict(zip(top_ids[b][j][:n], top_lp[b][j][:n])), ids[b][j]: token_lp[b][j]}
                    for j in range(int(count))])
    return out
