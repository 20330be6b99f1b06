"""Logprobs of the emitted tokens, as the runtime reports them.

What a request with ``SamplingParams(logprobs=N)`` reports: the log-softmax of the RAW
logits (before penalties and temperature), for the token it got and for the N most likely
tokens of that row, as vLLM's :class:`Logprob` objects. ``VocabShardedLogits.logprobs``
computes them on the shards (the row max and the exact int64 sum of the masses: the same
values at every TP size, within 1e-5 of float64 ``log_softmax``; the token's rank from an
exact sum of each rank's count); :func:`emitted_logprobs` turns one step's rows into the
per-token dicts the runtime reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..vocab_parallel import VocabShardedLogits


@dataclass
class Logprob:
    """One token's entry in a position's logprobs (vLLM's ``Logprob``).

    ``logprob``: its log-softmax of the raw logits; ``rank``: 1-based, in its row (the N most
    likely tokens are ranked 1 .. N in key order; the emitted token, when not among them, by
    the number of columns whose logit is at least its own); ``decoded_token``: its text (the
    driver fills it in when the LLM has a tokenizer, else None).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def position_logprobs(token: int, token_logprob: float, token_rank: int, top_ids: list[int],
                      top_logprobs: list[float]) -> dict[int, Logprob]:
    """One position's dict as vLLM builds it: the token first with its own rank, then the top
    tokens ranked ``1 .. N`` (the token among them keeps its place and takes that rank)."""
    entry = {token: Logprob(token_logprob, token_rank)}
    for i, (t, lp) in enumerate(zip(top_ids, top_logprobs)):
        entry[t] = Logprob(lp, i + 1)
    return entry


def emitted_logprobs(logits: VocabShardedLogits, row_index: torch.Tensor, tokens: torch.Tensor,
                     num_emitted: torch.Tensor, top_n: list[int]) -> list[list[dict[int, Logprob]]]:
    """What ``CompletionOutput.logprobs`` gets for one step of ``B`` requests.

    ``row_index`` ``[B, P]``: the logits row of each request's position (see
    ``SpecMetadata.request_row_index``); ``tokens`` ``[B, P]``: the tokens emitted there
    (padding ignored); ``num_emitted`` ``[B]``; ``top_n``: each request's N. Returns, per
    request, one ``{token id: Logprob}`` per emitted token (:func:`position_logprobs`: the
    emitted token and its N most likely tokens). Collective over the logits' group (every
    rank passes the same rows): :func:`step_logprobs`, then :func:`logprob_dicts`.
    """
    found = step_logprobs(logits, row_index, tokens, max(top_n, default=0))
    return logprob_dicts(*found, tokens, num_emitted, top_n)


def step_logprobs(logits: VocabShardedLogits, row_index: torch.Tensor, tokens: torch.Tensor,
                  top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device half of :func:`emitted_logprobs`, without a host sync (a CUDA graph captures
    it): ``(token_logprobs [B, P] float64, top_ids [B, P, top_n] int64, top_logprobs [B, P,
    top_n] float64, token_ranks [B, P] int64)`` of the rows ``row_index`` ``[B, P]`` and the
    tokens ``tokens`` ``[B, P]`` (negative: padding, any column is read). Each row's values
    depend on that row alone, so a request gets the same values in any batch. Collective over
    the logits' group."""
    rows, width = row_index.shape
    device = logits.local.device
    picked = VocabShardedLogits(logits.local[row_index.to(device).reshape(-1)], logits.vocab_offset,
                                logits.vocab_size, logits.exchange)
    flat_tokens = tokens.to(device).reshape(-1).clamp(min=0)  # padding positions: any column, never read
    token_lp, top_ids, top_lp, ranks = picked.logprobs(flat_tokens, top_n=top_n)
    return (token_lp.reshape(rows, width), top_ids.reshape(rows, width, top_n),
            top_lp.reshape(rows, width, top_n), ranks.reshape(rows, width))


def logprob_dicts(token_logprobs: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                  token_ranks: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor,
                  top_n: list[int]) -> list[list[dict[int, Logprob]]]:
    """The host half of :func:`emitted_logprobs`: per request ``b`` (``top_n[b]`` its N), one
    ``{token id: Logprob}`` per emitted token (the first ``num_emitted[b]`` of ``tokens[b]``)."""
    token_lp = token_logprobs.tolist()
    ranks = token_ranks.tolist()
    ids = tokens.clamp(min=0).tolist()
    top_ids = top_ids.tolist()
    top_lp = top_logprobs.tolist()
    return [[position_logprobs(ids[b][j], token_lp[b][j], ranks[b][j], top_ids[b][j][:n], top_lp[b][j][:n])
             for j in range(int(count))]
            for b, (n, count) in enumerate(zip(top_n, num_emitted.tolist()))]
