"""``SpecWorker``: one speculative step from target logits to accepted tokens.

``step`` selects the target's tokens, verifies the drafts (strict acceptance or
rejection sampling), applies forced acceptance when the benchmark env var asks for
it, and returns what the request emits and what the next step feeds. Every path is
chosen from flags that are equal on every rank (``SpecMetadata`` syncs them under
attention DP), so every rank runs the same collectives and returns the same tensors.

Rejection sampling runs on the shards (:mod:`tpspec.speculative.rejection`): no
``[rows, vocab]`` tensor crosses between ranks. A batch with a top-p row the candidates
cannot decide, and attention DP's own rows on a sharded head, gather the target rows
first; ``SpecWorker.sampling_stats`` counts the rows each way.

Host syncs: strict acceptance of an all-greedy or temperature-only batch (and forced
acceptance) adds none of its own. Filtered rows (their candidates) and rejection sampling read
values on the host, except in a deferred step (``step(deferred=True)``, what a CUDA graph
captures): the filters' host facts come from the requests' parameters (a ``FilterPlan``), and
instead of retrying or gathering a row the candidates cannot decide, the step reports
``decided`` False (equal on every rank) and the caller runs it again without deferring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..exchange.base import Channel
from ..sampling.ops import filtered_probs, sample_from_logits
from ..sampling.penalties import penalized_logits
from ..sampling.select import FilterPlan, SamplingStats, select_tokens, select_tokens_deferred
from ..vocab_parallel import VocabShardedLogits
from .accept import PAD_TOKEN, accept_from_targets, rejection_sample
from .forced import ForcedAcceptance
from .metadata import SpecMetadata
from .rejection import sharded_rejection_sample, sharded_rejection_sample_deferred

ACCEPT_KERNEL = True
"""Whether strict acceptance on CUDA runs :mod:`tpspec.speculative.accept_triton`'s one kernel instead of
the gather and the torch ops of :func:`~tpspec.speculative.accept.accept_from_targets`: the same values
under Triton's interpreter and on an H100 (``tests/advance_cases.py``, its GPU test in
``tests/test_runtime_gpu.py``)."""


@dataclass
class SpecStepOutput:
    """What one step produced, the same on every rank.

    ``accepted_tokens``: ``[B, D+1]`` int64, the tokens each request emits this step
    (accepted drafts, then the target's token), padded with -1.
    ``num_accepted``: ``[B]`` int64 in ``[1, D+1]`` (context requests: 1).
    ``next_input_tokens``: ``[B]`` int64, each request's last emitted token: the first
    input of its next step (followed by that step's drafts).
    ``target_tokens``: ``[R]`` int64 the target's token per logits row when the path
    computed it (strict acceptance, forced acceptance), else None.
    ``decided``: None, except from a deferred step (``SpecWorker.step(filter_plan=...)``) whose
    rows have filters: a 0-dim bool, False when a filtered row could not be decided on the shards
    without a host sync (the other tensors then mean nothing; run the step again without
    ``filter_plan``, on the same logits and metadata).
    """

    accepted_tokens: torch.Tensor
    num_accepted: torch.Tensor
    next_input_tokens: torch.Tensor
    target_tokens: torch.Tensor | None = None
    decided: torch.Tensor | None = None


class SpecWorker:
    """Ties selection and verification together for one step.

    ``acceptance``: ``"strict"`` (drafts accepted while they equal the target's own
    choice, greedy or sampled per row) or ``"rejection"`` (lossless rejection sampling
    against the target distributions, on the shards (see the module docstring); an
    all-greedy batch takes the strict path, which gives the same tokens).
    ``forced``: a :class:`ForcedAcceptance`, None, or ``"env"`` (read
    ``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS`` at the first step).
    ``sampling_stats``: a :class:`~tpspec.sampling.select.SamplingStats` of the rows its eager
    steps drew (or, under rejection sampling, verified) on shards and gathered.
    """

    def __init__(self, acceptance: str = "strict", *, forced: ForcedAcceptance | str | None = "env",
                 channel: int = Channel.TARGET) -> None:
        if acceptance not in ("strict", "rejection"):
            raise ValueError(f"acceptance must be 'strict' or 'rejection', got {acceptance!r}")
        if not (forced is None or forced == "env" or isinstance(forced, ForcedAcceptance)):
            raise ValueError(f"forced must be a ForcedAcceptance, None or 'env', got {forced!r}")
        self.acceptance = acceptance
        self.channel = channel
        self.sampling_stats = SamplingStats()  # rows drawn on shards / gathered, over every step
        self._forced: ForcedAcceptance | None = forced if isinstance(forced, ForcedAcceptance) else None
        self._forced_ready = forced != "env"

    def forced_acceptance(self, device: torch.device) -> ForcedAcceptance | None:
        if not self._forced_ready:
            self._forced = ForcedAcceptance.from_env(device=device)
            self._forced_ready = True
        return self._forced

    def step(
        self,
        target_logits: Any,
        draft_tokens: torch.Tensor | None,
        meta: SpecMetadata,
        draft_probs: torch.Tensor | None = None,
        *,
        draft_logits: torch.Tensor | None = None,
        is_warmup: bool = False,
        deferred: bool = False,
        filter_plan: FilterPlan | None = None,
        repeat: bool = False,
    ) -> SpecStepOutput:
        """One step. ``target_logits``: ``VocabShardedLogits`` with ``meta.num_rows`` rows
        (context request: 1 row; generation request: ``D+1`` rows, D = ``meta.draft_len``).
        ``draft_tokens``: ``[B, D]`` int in the target vocab (rows of context requests
        ignored; None when D == 0). Penalised requests are penalised from ``meta``'s
        occurrence counts and the drafts preceding each row before anything is chosen.
        ``draft_logits``: ``[B, D, shard]`` this rank's columns of the draft logits the drafts
        were sampled from at each request's temperature (``tpspec.speculative.draft``), for
        rejection sampling on the shards (cut by the requests' filters); ``draft_probs``:
        ``[B, D, V]`` full draft distributions for the gathered path. Neither: the drafts are
        treated as deterministic (one-hot q), which is still lossless. ``is_warmup``: eager
        CUDA-graph warm-up (no forced acceptance, its counter does not advance).
        ``deferred``: no host sync anywhere (what a CUDA graph captures): strict acceptance, or
        rejection sampling on the shards; ``filter_plan`` (:class:`~tpspec.sampling.select.FilterPlan`)
        gives the filters' host facts when the rows have filters (for rejection sampling with the
        candidate count of :func:`~tpspec.speculative.rejection.rejection_filter_plan`), and the
        output's ``decided`` says whether every row was decided. ``repeat``: this runs the step
        that was just run (deferred, undecided) again: forced acceptance reuses that step's draw.
        Collective over the logits' group.

        Arguments are checked on each rank before the first collective. Under attention
        DP each rank's batch is its own, so a rank whose drafts have the wrong shape
        raises alone while its peers wait in the collective until the process group's
        timeout: the engine checks batches through its shared step plan first, and a
        direct caller under attention DP should do the same (an extra collective per step
        here would slow every correct step).
        """
        batch, num_drafts = meta.num_requests, meta.draft_len
        device = target_logits.local.device
        drafts = self._check_drafts(draft_tokens, batch, num_drafts, device)
        lens = meta.request_draft_len.to(device)
        row_index = meta.request_row_index.to(device)
        forced = self.forced_acceptance(device)
        use_forced = forced is not None and not is_warmup
        if repeat and use_forced:
            forced.rewind()

        rs = meta.row_sampling(draft_tokens=drafts)  # penalised rows count the drafts before them
        row_tokens: torch.Tensor | None = None
        decided: torch.Tensor | None = None

        def target_tokens(stats: SamplingStats | None = None) -> torch.Tensor:
            nonlocal decided
            if not deferred:
                return select_tokens(target_logits, rs, channel=self.channel, stats=stats)
            tokens, ok = select_tokens_deferred(target_logits, rs, filter_plan, channel=self.channel)
            if ok is not None:
                decided = ok if decided is None else decided & ok
            return tokens

        if self.acceptance == "strict" or meta.is_all_greedy:
            row_tokens = target_tokens(self.sampling_stats)
            # Lengths come from the metadata: no value check, so this path has no host sync.
            if ACCEPT_KERNEL and device.type == "cuda":
                from . import accept_triton

                accepted, num = accept_triton.accept(row_tokens, row_index, drafts, lens)
            else:
                accepted, num = accept_from_targets(row_tokens[row_index], drafts, lens, check_values=False)
        elif deferred:
            if draft_probs is not None or not self._rows_are_shared(target_logits, meta):
                raise ValueError("a deferred rejection-sampling step verifies on the shards: no draft_probs, "
                                 "and rows every rank holds alike")
            if meta.num_contexts:
                raise ValueError("a deferred rejection-sampling step has no context request")
            accepted, num, decided = self._reject_on_shards(target_logits, rs, drafts, meta, draft_logits,
                                                            filter_plan, deferred=True)
            if use_forced:
                row_tokens = target_tokens()
        elif (draft_probs is None and self._rows_are_shared(target_logits, meta)
              and (verified := self._reject_on_shards(target_logits, rs, drafts, meta, draft_logits)) is not None):
            accepted, num = verified
            self.sampling_stats.rows_sharded += meta.num_rows
            if meta.num_contexts or use_forced:
                # Context requests (and forced acceptance) take the target's own per-row draw,
                # the token strict acceptance would emit for them too.
                row_tokens = target_tokens()
                ctx = meta.is_context.to(device)
                accepted = torch.where(ctx.reshape(-1, 1), torch.full_like(accepted, PAD_TOKEN), accepted)
                accepted[:, 0] = torch.where(ctx, row_tokens[row_index[:, 0]], accepted[:, 0])
                num = torch.where(ctx, torch.ones_like(num), num)
        else:
            if draft_logits is not None:  # the gathered fallback needs the full draft laws
                draft_probs = self._gathered_draft_probs(target_logits, draft_logits, meta)
            full = penalized_logits(target_logits, rs.penalties).gather()
            self.sampling_stats.rows_gathered += meta.num_rows  # rejection sampling needs the full laws
            probs = filtered_probs(full, rs.temperature, rs.top_k, rs.top_p, rs.min_p)
            accepted, num = rejection_sample(draft_probs, drafts, probs[row_index], meta.request_seeds,
                                             meta.request_offsets, draft_lens=lens)
            if meta.num_contexts or use_forced:
                # Context requests (and forced acceptance) take the target's own per-row
                # draw, the token strict acceptance would emit for them too.
                row_tokens = sample_from_logits(full, rs.temperature, rs.seeds, rs.offsets, rs.top_k, rs.top_p,
                                                rs.min_p)
                ctx = meta.is_context.to(device).reshape(-1, 1)
                ctx_accepted = torch.full_like(accepted, PAD_TOKEN)
                ctx_accepted[:, 0] = row_tokens[row_index[:, 0]]
                accepted = torch.where(ctx, ctx_accepted, accepted)
                num = torch.where(ctx.reshape(-1), torch.ones_like(num), num)
        if use_forced:
            forced_out = forced.apply(row_tokens[row_index], drafts, lens, meta.slot_ids.to(device))
            if forced_out is not None:
                accepted, num = forced_out
        next_input = accepted.gather(1, (num - 1).reshape(-1, 1)).reshape(-1)
        return SpecStepOutput(accepted, num, next_input, row_tokens, decided)

    @staticmethod
    def _rows_are_shared(target_logits: Any, meta: SpecMetadata) -> bool:
        """Whether every rank of the logits' exchange holds these same rows, so that decisions read
        from them are the same on every rank: plain TP, or a head whose exchange spans one rank.
        (Attention DP's ranks hold their own rows: a stacked slice, or rows of one rank only.)"""
        if target_logits.local.shape[0] != meta.num_rows:
            return False
        return not meta.sync_flags or target_logits.exchange.world_size == 1

    @staticmethod
    def _gathered_draft_probs(target_logits: Any, draft_logits: torch.Tensor, meta: SpecMetadata) -> torch.Tensor:
        """``[B, D, V]`` filtered draft distributions from each rank's ``[B, D, shard]`` draft
        logits columns (one all-gather): the fallback of rejection sampling on the shards."""
        batch, num_drafts, width = draft_logits.shape
        rows = VocabShardedLogits(draft_logits.reshape(-1, width), target_logits.vocab_offset,
                                  target_logits.vocab_size, target_logits.exchange)
        req = meta.request_sampling(meta.request_offsets)

        def per_row(f):
            return None if f is None else f.repeat_interleave(num_drafts)

        probs = filtered_probs(rows.gather(), per_row(req.temperature), per_row(req.top_k), per_row(req.top_p),
                               per_row(req.min_p))
        return probs.view(batch, num_drafts, -1)

    def _reject_on_shards(self, target_logits: Any, rs: Any, drafts: torch.Tensor, meta: SpecMetadata,
                          draft_logits: torch.Tensor | None, filter_plan: FilterPlan | None = None, *,
                          deferred: bool = False) -> tuple | None:
        """Rejection sampling on the shards (penalties applied to each rank's slice first), or None
        when a filtered row cannot be decided there (every rank alike). ``deferred``: without a host
        sync, ``(accepted, num, decided)`` (see ``sharded_rejection_sample_deferred``)."""
        logits = penalized_logits(target_logits, rs.penalties)
        req = meta.request_sampling(meta.request_offsets)
        device = logits.local.device
        args = (logits, meta.request_row_index.to(device), req.temperature, drafts, meta.request_draft_len.to(device),
                meta.request_seeds, meta.request_offsets, draft_logits)
        filters = dict(top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, channel=self.channel)
        if not deferred:
            return sharded_rejection_sample(*args, **filters)
        if filter_plan is None:
            if req.has_filters:
                raise ValueError("rows with filters need their FilterPlan to verify without a host sync")
            filter_plan = FilterPlan(any_filtered=False)
        return sharded_rejection_sample_deferred(*args, filter_plan, **filters)

    @staticmethod
    def _check_drafts(draft_tokens: torch.Tensor | None, batch: int, num_drafts: int, device: torch.device) -> torch.Tensor:
        if draft_tokens is None:
            if num_drafts:
                raise ValueError(f"draft_tokens is None but the step has draft_len={num_drafts}")
            return torch.zeros(batch, 0, dtype=torch.int64, device=device)
        if not isinstance(draft_tokens, torch.Tensor) or tuple(draft_tokens.shape) != (batch, num_drafts):
            raise ValueError(f"draft_tokens must be [B={batch}, D={num_drafts}], got {getattr(draft_tokens, 'shape', draft_tokens)}")
        if draft_tokens.is_floating_point():
            raise ValueError(f"draft_tokens must be integer token ids, got {draft_tokens.dtype}")
        return draft_tokens.to(device=device, dtype=torch.int64)
