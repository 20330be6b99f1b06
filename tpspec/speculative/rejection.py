"""Rejection sampling on vocabulary shards (Leviathan et al. 2023): lossless, and no
``[rows, vocab]`` tensor crosses between ranks.

Each rank holds its columns of the target rows ``p_0 .. p_D`` of every request and of the
draft rows ``q_0 .. q_{D-1}`` the drafts were drawn from (in the target's column layout).
With the masses of ``docs/determinism.md`` (``s = logit / T``, ``P_i = floor(exp(s_i - m) *
2**40)`` in the portable arithmetic, ``m`` the row max from one key exchange), every rank
learns, in one exact int64 sum over the group, each row's total ``Z`` and the masses
``P(x_j)``, ``Q(x_j)`` of each draft from the rank that owns its column. Then on every rank
alike:

* draft ``j`` is accepted when ``u_j * Q(x_j) * Z_p < P(x_j) * Z_q`` (products of the exact
  integers in float64; ``u_j`` the request's acceptance uniform of the position draft ``j``
  proposes), i.e. with probability ``min(1, p(x)/q(x))``;
* at the first rejection ``n`` the token is drawn from ``max(0, p_n - q_n)``, after all drafts
  from ``p_D`` (``q = 0``), by an exponential race: each rank scores its columns
  ``r_i / E_i`` (``r_i = P_i / Z_p - Q_i / Z_q`` in float64, ``E_i`` the Philox exponential of
  the residual lane of the emitted position and the global column) and one key exchange takes
  the max. Every draw is keyed by the output position it decides (``tpspec.sampling.streams``),
  so no draw is used for two decisions of a request.
  Should rounding leave no residual mass anywhere, the race runs on ``p_n``.

Filters (top-k, top-p, min-p; ``docs/determinism.md``'s semantics) cut each target row to
a prefix in key order: every rank sends its best keys (the sampling layer's certified
candidates, at least ``max(k)`` of them) and the filters run on them, so the lowest kept
key is every rank's cut. Top-k is exact from the candidates, min-p alone is a local mass
threshold, and top-p without top-k is exact when its prefix ends above every rank's last
sent key; a batch with a row that is not (rare: a flat row) is left to the gathered path
(the function returns None, on every rank alike). Sampled draft rows are cut by the same
filters (their drafts were drawn from the filtered q).

A greedy request (temperature below the greedy threshold) has one-hot ``p`` at the row's
argmax; drafts given without their distribution (greedy drafting, n-gram) have one-hot ``q``
at the draft. So strict greedy verification is the special case of the same code. Three
collectives in all (two more with filters: the candidates and the unfiltered totals): one
key exchange of row maxima, one int64 sum, one key exchange of the draws. Every decision
reads only what every rank holds alike.
"""

from __future__ import annotations

import torch

from ..exchange.base import Channel
from ..keys import (
    EMPTY_KEY,
    GREEDY_TEMPERATURE_THRESHOLD,
    MASS_BITS,
    canonical_float32,
    column_masses,
    exponential_from_words,
    min_p_threshold,
    pack_keys,
    philox_words,
    top_p_fixed,
    top_p_target,
    unpack_keys,
)
from ..sampling.ops import filter_flags, scaled_scores, sorted_filter_mask
from ..sampling.select import FilterPlan, candidate_bucket
from ..sampling.streams import acceptance_uniforms, residual_offsets
from ..vocab_parallel import VocabShardedLogits
from .accept import PAD_TOKEN

ONE_HOT_MASS = 1 << MASS_BITS


def _keys(values: torch.Tensor, columns: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Row-best keys of float32 ``values`` ``[N, W]`` at global ``columns`` ``[W]``; columns outside
    ``keep`` (``[N, W]`` or ``[W]`` bool) never win (``EMPTY_KEY`` for a row with none)."""
    keys = pack_keys(canonical_float32(values), columns.reshape(1, -1))
    keys = torch.where(keep, keys, torch.full_like(keys, EMPTY_KEY))
    if keys.shape[1] == 0:
        return torch.full((keys.shape[0],), EMPTY_KEY, dtype=torch.int64, device=keys.device)
    return keys.max(dim=1).values


def _local_mass_at(masses: torch.Tensor, tokens: torch.Tensor, offset: int) -> torch.Tensor:
    """``masses [N, W]`` at global column ``tokens [N]`` when this rank holds it, else 0."""
    width = masses.shape[1]
    inside = (tokens >= offset) & (tokens < offset + width)
    at = torch.where(inside, tokens - offset, torch.zeros_like(tokens)).reshape(-1, 1)
    picked = masses.gather(1, at).reshape(-1) if width else torch.zeros_like(tokens)
    return torch.where(inside, picked, torch.zeros_like(picked))


def _filter_keep(exchange, keys: torch.Tensor, masses: torch.Tensor, row_max: torch.Tensor, vocab_size: int,
                 top_k, top_p, min_p, plan: FilterPlan, channel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of this rank's columns the filters keep, ``[N, W]`` bool, and ``[N]`` bool: the rows
    decided on the shards (see the module docstring). ``keys``/``masses``: ``[N, W]`` of the rows
    (padding: ``EMPTY_KEY`` / 0); ``top_k``/``top_p``/``min_p``: ``[N]`` or None; ``plan``: the
    host facts (``plan.candidates`` keys a rank, at least every top-k; no filter on at all when
    not ``plan.any_filtered``)."""
    rows, width = keys.shape
    device = keys.device
    real = keys != EMPTY_KEY
    keep = real.clone()
    if not plan.any_filtered:
        return keep, torch.ones(rows, dtype=torch.bool, device=device)
    k_on, p_on, m_on = filter_flags(rows, vocab_size, device, top_k, top_p, min_p)
    total = exchange.sum_rows(masses.sum(dim=1), channel=channel)  # the unfiltered Z of each row
    count = min(plan.candidates, width)
    local = torch.sort(keys, dim=1, descending=True).values[:, :count]
    gathered = exchange.gather_rows(local.contiguous(), channel=channel)
    floor = (gathered.view(rows, -1, count)[:, :, count - 1].max(dim=1).values if count < width
             else torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=device))
    ranked = torch.sort(gathered, dim=1, descending=True).values
    kept = sorted_filter_mask(ranked, k_on, top_k, p_on, top_p, m_on, min_p, total=total)
    cut = torch.where(kept, ranked, torch.full_like(ranked, 2**63 - 1)).min(dim=1).values
    prefix = k_on | p_on
    keep = torch.where(prefix.reshape(-1, 1), real & (keys >= cut.reshape(-1, 1)), keep)
    if min_p is not None:
        above = masses >= min_p_threshold(min_p).reshape(-1, 1)
        keep = torch.where((m_on & ~prefix).reshape(-1, 1), real & above, keep)
    # Top-p without top-k is decided when its prefix reaches the target among the candidates and
    # ends above every rank's last sent key (every column above that was sent).
    values, _ = unpack_keys(ranked)
    ranked_mass = torch.where(ranked != EMPTY_KEY, column_masses(torch.where(ranked != EMPTY_KEY, values,
                                                                             torch.zeros_like(values)), row_max),
                              torch.zeros_like(ranked))
    reached = torch.where(kept, ranked_mass, torch.zeros_like(ranked_mass)).sum(dim=1) >= top_p_target(
        total, top_p_fixed(top_p if top_p is not None else torch.ones(rows, device=device)))
    certified = reached & (cut >= floor)
    undecided = p_on & ~k_on & ~certified & torch.isfinite(row_max)
    return keep, ~undecided


def rejection_filter_plan(top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                          vocab_size: int) -> FilterPlan:
    """The :class:`FilterPlan` :func:`sharded_rejection_sample` runs with, read from the
    requests' ``[B]`` filters (one host transfer; None = off): every rank sends
    ``candidate_bucket`` of the largest top-k (at least 64) candidate keys a row."""
    any_on = torch.zeros((), dtype=torch.bool)
    k_max = 0
    if top_k is not None or top_p is not None or min_p is not None:
        device = next(f for f in (top_k, top_p, min_p) if f is not None).device
        rows = next(f for f in (top_k, top_p, min_p) if f is not None).shape[0]
        k_on, p_on, m_on = filter_flags(rows, vocab_size, device, top_k, top_p, min_p)
        k_value = torch.zeros(rows, dtype=torch.int64, device=device) if top_k is None else torch.where(
            k_on, top_k.to(torch.int64), torch.zeros_like(top_k, dtype=torch.int64))
        host = torch.stack([(k_on | p_on | m_on).any().to(torch.int64),
                            k_value.max() if rows else torch.zeros((), dtype=torch.int64, device=device)]).cpu()
        any_on, k_max = bool(host[0]), int(host[1])
    return FilterPlan(candidates=candidate_bucket(k_max), any_filtered=bool(any_on))


def sharded_rejection_sample(
    target: VocabShardedLogits,
    row_index: torch.Tensor,
    temperature: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    draft_logits: torch.Tensor | None = None,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    channel: int = Channel.TARGET,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Verify every request's drafts on the shards of ``target`` (see the module docstring).

    ``target``: a plain :class:`VocabShardedLogits` (this rank's ``[R, W]`` slice);
    ``row_index``: ``[B, D+1]`` int64 rows of each request's positions; ``temperature``: ``[B]``
    (the request's; below the greedy threshold = greedy); ``draft_tokens``: ``[B, D]`` target ids;
    ``draft_lens``: ``[B]`` drafts that count (0 for a context request: one token from ``p_0``);
    ``seeds``/``offsets``: ``[B]`` int64, each request's stream and the offset of the first
    output position it emits this step (``SpecMetadata.request_offsets``; the uniforms and the
    residual race read the lanes of positions ``p .. p + D``); ``draft_logits``: ``[B, D, W]`` this
    rank's columns of the draft logits each sampled draft was drawn from at the request's
    temperature, or None (every draft one-hot). Greedy requests' drafts are one-hot.
    ``top_k``/``top_p``/``min_p``: ``[B]`` filters of each request, or None (off): they cut its
    target rows and its sampled draft rows alike (the drafts were drawn from the filtered q).

    Returns ``(accepted_tokens [B, D+1] int64 padded with -1, num_accepted [B] int64)``, the same
    on every rank, and the same at every TP size for the same logits; None when a filtered row
    cannot be decided on the shards (every rank returns None alike). Collective over the group;
    reads the filters' facts and the verdict on the host (:func:`sharded_rejection_sample_deferred`
    is the same without a host sync).
    """
    plan = rejection_filter_plan(top_k, top_p, min_p, target.vocab_size)
    accepted, num, decided = sharded_rejection_sample_deferred(
        target, row_index, temperature, draft_tokens, draft_lens, seeds, offsets, draft_logits, plan,
        top_k=top_k, top_p=top_p, min_p=min_p, channel=channel)
    if not bool(decided):
        return None
    return accepted, num


def sharded_rejection_sample_deferred(
    target: VocabShardedLogits,
    row_index: torch.Tensor,
    temperature: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    draft_logits: torch.Tensor | None,
    plan: FilterPlan,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    channel: int = Channel.TARGET,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sharded_rejection_sample` without a host sync (what a CUDA graph captures):
    ``(accepted_tokens, num_accepted, decided)``, ``decided`` a 0-dim bool equal on every rank.

    ``plan``: the filters' host facts, :func:`rejection_filter_plan` of the same filters (or the
    same facts known ahead from the requests' parameters: ``candidates`` must be the same, since
    it decides which rows are certified). When ``decided`` is False a filtered row could not be
    decided on the shards and the first two tensors mean nothing: the caller verifies the step
    on the gathered rows instead, as it does when :func:`sharded_rejection_sample` returns None.
    """
    filtered = any(f is not None for f in (top_k, top_p, min_p))
    exchange = target.exchange
    local = target.local
    device = local.device
    batch, num_drafts = draft_tokens.shape
    decided = torch.ones((), dtype=torch.bool, device=device)
    width, offset = target.shard_width, target.vocab_offset
    columns = torch.arange(offset, offset + width, dtype=torch.int64, device=device)
    real = (columns < target.vocab_size).reshape(1, -1)
    t = temperature.to(device=device, dtype=torch.float32)
    greedy = t < GREEDY_TEMPERATURE_THRESHOLD
    drafts = draft_tokens.to(device=device, dtype=torch.int64)
    lens = draft_lens.to(device=device, dtype=torch.int64)
    seeds = seeds.to(device=device, dtype=torch.int64)
    offsets = offsets.to(device=device, dtype=torch.int64)

    # Scores of every p row, then of every sampled q row; padding columns at -inf.
    p_rows = batch * (num_drafts + 1)
    scores = [scaled_scores(local.index_select(0, row_index.to(device).reshape(-1)),
                            t.repeat_interleave(num_drafts + 1))]
    sampled_q = draft_logits is not None and num_drafts > 0
    if sampled_q:
        scores.append(scaled_scores(draft_logits.to(device).reshape(-1, width), t.repeat_interleave(num_drafts)))
    scores = torch.cat(scores)
    scores = torch.where(real, scores, torch.full_like(scores, float("-inf")))
    # (1) Each row's max score and its column.
    best = exchange.max_keys(_keys(scores, columns, real.expand_as(scores)), channel=channel)
    row_max, row_arg = unpack_keys(best)
    masses = torch.where(real, column_masses(scores, row_max), torch.zeros((), dtype=torch.int64, device=device))
    one_hot_row = ~torch.isfinite(row_max)
    one_hot_row[:p_rows] |= greedy.repeat_interleave(num_drafts + 1)
    if sampled_q:
        one_hot_row[p_rows:] |= greedy.repeat_interleave(num_drafts)
    at_arg = (columns.reshape(1, -1) == row_arg.reshape(-1, 1)).to(torch.int64) * ONE_HOT_MASS
    if sampled_q:  # a one-hot q row sits at its draft (greedy drafts are the draft row's argmax)
        at_arg[p_rows:] = (columns.reshape(1, -1) == drafts.reshape(-1, 1)).to(torch.int64) * ONE_HOT_MASS
    if filtered:  # every p row, and every sampled q row, cut to what its request's filters keep
        keys = torch.where(real, pack_keys(canonical_float32(scores), columns.reshape(1, -1)),
                           torch.full((), EMPTY_KEY, dtype=torch.int64, device=device))

        def per_row(f):
            if f is None:
                return None
            f = f.to(device)
            rows_of = [f.repeat_interleave(num_drafts + 1)] + ([f.repeat_interleave(num_drafts)] if sampled_q else [])
            return torch.cat(rows_of)

        keep, row_decided = _filter_keep(exchange, keys, masses, row_max, target.vocab_size, per_row(top_k),
                                         per_row(top_p), per_row(min_p), plan, channel)
        decided = row_decided.all()
        masses = torch.where(keep, masses, torch.zeros_like(masses))
    masses = torch.where(one_hot_row.reshape(-1, 1), at_arg, masses)
    p_mass = masses[:p_rows].view(batch, num_drafts + 1, width)
    if sampled_q:
        q_mass = masses[p_rows:].view(batch, num_drafts, width)
    else:
        q_mass = (columns.reshape(1, 1, -1) == drafts.unsqueeze(2)).to(torch.int64) * ONE_HOT_MASS

    # (2) One exact int64 sum: row totals and the masses at each draft.
    flat_drafts = drafts.reshape(-1)
    sums = exchange.sum_rows(torch.cat([
        p_mass.sum(dim=2).reshape(-1), q_mass.sum(dim=2).reshape(-1),
        _local_mass_at(p_mass[:, :num_drafts].reshape(-1, width), flat_drafts, offset),
        _local_mass_at(q_mass.reshape(-1, width), flat_drafts, offset),
    ]), channel=channel)
    z_p, z_q, p_x, q_x = torch.split(sums, [p_rows, batch * num_drafts, batch * num_drafts, batch * num_drafts])
    z_p, z_q = z_p.view(batch, num_drafts + 1), z_q.view(batch, num_drafts)
    p_x, q_x = p_x.view(batch, num_drafts), q_x.view(batch, num_drafts)

    positions = torch.arange(num_drafts + 1, dtype=torch.int64, device=device)
    counted = positions[:num_drafts].reshape(1, -1) < lens.reshape(-1, 1)
    u = acceptance_uniforms(seeds, offsets, num_drafts)
    accept = (u * q_x.to(torch.float64) * z_p[:, :num_drafts].to(torch.float64)
              < p_x.to(torch.float64) * z_q.to(torch.float64)) & counted
    n = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)

    # (3) The final token: the residual race at row n (q = 0 after the last draft), p_n as backup.
    rows = torch.arange(batch, device=device)
    p_n = p_mass[rows, n].to(torch.float64) / z_p[rows, n].to(torch.float64).reshape(-1, 1)
    rejected = (n < lens).reshape(-1, 1)
    if num_drafts:
        at = n.clamp(max=num_drafts - 1)
        q_n = q_mass[rows, at].to(torch.float64) / z_q[rows, at].to(torch.float64).reshape(-1, 1)
        q_n = torch.where(rejected, q_n, torch.zeros_like(q_n))
    else:
        q_n = torch.zeros_like(p_n)
    residual = (p_n - q_n).clamp(min=0.0)
    column_range = (offset, offset + width - 1)  # known on the host: no sync (this runs inside CUDA graphs)
    race = exponential_from_words(philox_words(seeds, residual_offsets(offsets, n), columns,
                                               column_range)).to(torch.float64)
    keys = torch.cat([_keys((residual / race).to(torch.float32), columns, real & (residual > 0)),
                      _keys((p_n / race).to(torch.float32), columns, real & (p_n > 0))])
    won = exchange.max_keys(keys, channel=channel)
    _, won_columns = unpack_keys(won)
    final = torch.where(won[:batch] == EMPTY_KEY, won_columns[batch:], won_columns[:batch])

    padded = torch.cat([drafts, torch.full((batch, 1), PAD_TOKEN, dtype=torch.int64, device=device)], dim=1)
    accepted = torch.where(positions.reshape(1, -1) < n.reshape(-1, 1), padded, PAD_TOKEN)
    accepted = accepted.scatter(1, n.reshape(-1, 1), final.reshape(-1, 1))
    return accepted, n + 1, decided
